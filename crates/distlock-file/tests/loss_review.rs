//! Adversarial review of the file backend's loss signal (the notifier's records of held files, the
//! keeper): a deletion or replacement of a held lock file must make the guard `Lost`, promptly.
// Test helpers panic on setup failures, like the tests themselves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{LockState, Locks};
use distlock_file::{FileBackend, FileConfig};

const BOUND: Duration = Duration::from_secs(5);

fn locks(dir: &Path) -> Locks {
    Locks::new(FileBackend::new(dir).unwrap())
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The lock directory renamed away while held, with no waiter of the old file anywhere: another
/// process (here another backend) locks a new file of the name with a plain try. Two holders; the
/// first must be told. Nothing happens to the held inode (a rename of its parent raises no event on
/// it), so the notifier, which only looks at a held file when its watch has an event, never looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_lock_directory_without_a_waiter_makes_the_holder_lost() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("locks");
    let holder = locks(&dir);
    let guard = holder.lock("x").unwrap().acquire().await.unwrap();
    std::fs::rename(&dir, root.path().join("locks.old")).unwrap();
    let other = locks(&dir);
    let second = other
        .lock("x")
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("a new file of the name is free");
    // Two holders of "x" now.
    let told = tokio::time::timeout(BOUND, guard.lost()).await;
    second.release().await.unwrap();
    told.expect("two holders of one name, and the first was never told it lost the lock");
}

/// A runtime built without `enable_io` (the notifier catches tokio's panic and disables inotify for
/// the backend): the grant then carries no loss signal at all (`grant` adds one only with a watch),
/// so a deleted lock file is never reported, although the module promises a check every second
/// "without inotify".
#[test]
fn a_hold_made_without_inotify_reports_a_deletion() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("no-io");
    let locks = Locks::new(backend);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let guard = locks.lock("no-io").unwrap().acquire().await.unwrap();
        std::fs::remove_file(&path).unwrap();
        // Another process can now lock a new file of the name.
        let other = self::locks(dir.path());
        let second = other.lock("no-io").unwrap().try_acquire().await.unwrap();
        assert!(second.is_some(), "the new file is free");
        tokio::time::timeout(BOUND, guard.lost())
            .await
            .expect("a hold made without inotify is never reported lost");
    });
}

/// A deleter of the lock file racing the acquires (a cleanup job): every hold granted must become
/// `Lost` once its file is deleted. A try whose `inotify_add_watch` fails (ENOENT: the file was
/// unlinked between its open and the watch) sets `watch_failed`, reopens, locks and is granted
/// with no watch, hence no loss signal at all: that hold is never told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hold_granted_under_a_racing_deleter_is_told_of_its_deletion() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let backend = FileBackend::from_config(FileConfig::new(dir.path()).with_sync(false)).unwrap();
    let path = backend.lock_file("raced");
    let locks = Locks::new(backend);
    let stop = Arc::new(AtomicBool::new(false));
    let deleter = {
        let (stop, path) = (stop.clone(), path.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = std::fs::remove_file(&path);
            }
        })
    };
    let started = Instant::now();
    let mut granted = 0;
    let mut failure = None;
    while started.elapsed() < Duration::from_secs(20) && granted < 3000 {
        let Ok(Some(guard)) = locks.lock("raced").unwrap().try_acquire().await else {
            continue;
        };
        granted += 1;
        if tokio::time::timeout(BOUND, guard.lost()).await.is_err() {
            failure = Some(granted);
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    deleter.join().unwrap();
    if let Some(n) = failure {
        panic!("hold {n} was never told its lock file was deleted (a later delete still goes on)");
    }
    eprintln!("{granted} holds, all told");
}

/// The reader's queue overflows while its runtime is not driven (the kernel drops the deletion's
/// event and queues IN_Q_OVERFLOW): the reader must check every held file when it runs again.
#[test]
fn a_deletion_lost_in_an_overflowed_queue_is_still_reported() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let backend = FileBackend::from_config(FileConfig::new(dir.path()).with_sync(false)).unwrap();
    let paths = FileBackend::new(dir.path()).unwrap();
    let locks = Locks::new(backend);
    let runtime = current_thread();
    let (victim, noisy_a, noisy_b) = runtime.block_on(async {
        (
            locks.lock("victim").unwrap().acquire().await.unwrap(),
            locks.lock("noisy-a").unwrap().acquire().await.unwrap(),
            locks.lock("noisy-b").unwrap().acquire().await.unwrap(),
        )
    });
    // The runtime is idle: nobody reads the instance. Alternate two files so the kernel cannot merge
    // consecutive identical events; 20,000 opens and closes each fill the 16,384-event queue.
    let (a, b) = (paths.lock_file("noisy-a"), paths.lock_file("noisy-b"));
    for _ in 0..20_000 {
        drop(std::fs::File::open(&a).unwrap());
        drop(std::fs::File::open(&b).unwrap());
    }
    std::fs::remove_file(paths.lock_file("victim")).unwrap();
    runtime.block_on(async {
        tokio::time::timeout(BOUND, victim.lost())
            .await
            .expect("a deletion whose event the overflow dropped went unnoticed");
        assert_eq!(noisy_a.state(), LockState::Held);
        assert_eq!(noisy_b.state(), LockState::Held);
    });
}

/// The holder's current-thread runtime is kept but idle (sync code between `block_on`s, the guard's
/// state read synchronously): the inotify reader on it never runs, so the deletion is reported only
/// when the runtime is driven again. The keeper steps in only when that runtime is dropped.
#[test]
fn a_deletion_while_the_holders_runtime_is_idle_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("idle");
    let locks = Locks::new(backend);
    let runtime = current_thread();
    let guard = runtime.block_on(async { locks.lock("idle").unwrap().acquire().await.unwrap() });
    std::fs::remove_file(&path).unwrap();
    let deadline = Instant::now() + BOUND;
    while guard.state() != LockState::Lost {
        assert!(
            Instant::now() < deadline,
            "the deletion went unnoticed for {BOUND:?} while the holder's runtime was idle"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(runtime);
}

/// The backend's one inotify instance runs its reader on the runtime that first needed it. Here a
/// current-thread runtime took a lock first (and is then kept, idle); a busy multi-thread runtime
/// then holds another lock of the same backend, whose watch joins the idle runtime's instance. The
/// deletion of the busy runtime's lock file is never read: its hold stays `Held`.
#[test]
fn a_hold_on_a_driven_runtime_is_not_left_to_an_idle_runtimes_reader() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("busy");
    let locks = Locks::new(backend);
    let idle = current_thread();
    let first = idle.block_on(async { locks.lock("first").unwrap().acquire().await.unwrap() });
    let busy = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    busy.block_on(async {
        let guard = locks.lock("busy").unwrap().acquire().await.unwrap();
        std::fs::remove_file(&path).unwrap();
        tokio::time::timeout(BOUND, guard.lost())
            .await
            .expect("a deletion on a driven runtime went unnoticed: its watch's reader runs on an idle runtime");
    });
    drop(first);
    drop(idle);
}

/// Holds whose reader's runtime is dropped, their files deleted right away with no runtime about
/// (before or while the keeper watches them again): each is reported by the keeper; holds of the
/// same backend taken meanwhile on another runtime stay Held, and their own deletion is reported.
#[test]
fn holds_whose_runtime_is_dropped_are_reported_by_the_keeper() {
    for round in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::new(dir.path()).unwrap();
        let paths = FileBackend::new(dir.path()).unwrap();
        let locks = Locks::new(backend);
        let first = current_thread();
        let guards: Vec<_> = first.block_on(async {
            let mut guards = Vec::new();
            for i in 0..4 {
                guards.push(
                    locks
                        .lock(&format!("k{i}"))
                        .unwrap()
                        .acquire()
                        .await
                        .unwrap(),
                );
            }
            guards
        });
        drop(first);
        std::fs::remove_file(paths.lock_file("k0")).unwrap();
        let other = dir.path().join("other");
        std::fs::write(&other, b"").unwrap();
        std::fs::rename(&other, paths.lock_file("k1")).unwrap();
        let second = current_thread();
        second.block_on(async {
            let later = locks.lock("later").unwrap().acquire().await.unwrap();
            for i in [0, 1] {
                tokio::time::timeout(BOUND, guards[i].lost())
                    .await
                    .unwrap_or_else(|_| panic!("round {round}: k{i} went unnoticed"));
            }
            assert_eq!(guards[2].state(), LockState::Held, "round {round}");
            std::fs::remove_file(paths.lock_file("k3")).unwrap();
            tokio::time::timeout(BOUND, guards[3].lost())
                .await
                .unwrap_or_else(|_| panic!("round {round}: k3 went unnoticed"));
            assert_eq!(later.state(), LockState::Held);
            assert_eq!(guards[2].state(), LockState::Held, "round {round}");
            later.release().await.unwrap();
        });
        drop(second);
        assert_eq!(guards[2].state(), LockState::Held, "round {round}");
    }
}

/// Two `Locks` over clones of one backend take turns on one file (a waiter of one and the hold of
/// the other share the inotify watch): a released hold is never reported when the file is deleted
/// later; the current hold is, and a later hold of a new file of the name is not told of the
/// earlier hold's loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_watches_report_only_the_current_hold() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("s");
    let one = Locks::new(backend.clone());
    let two = Locks::new(backend);
    for round in 0..20 {
        let a = one.lock("s").unwrap().acquire().await.unwrap();
        let lock = two.lock("s").unwrap();
        let waiting = tokio::spawn(async move { lock.acquire().await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        a.release().await.unwrap();
        let b = tokio::time::timeout(BOUND, waiting)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        tokio::time::timeout(BOUND, b.lost())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the current hold was not told"));
        // A new file of the name, held by the first `Locks` again: not told of b's loss.
        let c = one.lock("s").unwrap().acquire().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(c.state(), LockState::Held, "round {round}: a false loss");
        let _ = b.release().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            c.state(),
            LockState::Held,
            "round {round}: a false loss after b's release"
        );
        c.release().await.unwrap();
    }
}

/// Several threads, each with a current-thread runtime per round, share one backend: the inotify
/// instance dies with whichever runtime started it while other threads are mid-acquire (their
/// watch on it, their hold's record being made). Each hold, its runtime dropped, has its file
/// deleted: every one must be reported (by a live reader or the keeper).
#[test]
fn holds_made_while_other_runtimes_die_are_all_told() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let backend = FileBackend::from_config(FileConfig::new(dir.path()).with_sync(false)).unwrap();
    let locks = Locks::new(backend.clone());
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (locks, backend) = (locks.clone(), backend.clone());
            std::thread::spawn(move || {
                for round in 0..150 {
                    let name = format!("t{t}-{round}");
                    let runtime = current_thread();
                    let guard = runtime
                        .block_on(async { locks.lock(&name).unwrap().acquire().await.unwrap() });
                    drop(runtime);
                    std::fs::remove_file(backend.lock_file(&name)).unwrap();
                    let deadline = Instant::now() + BOUND;
                    while guard.state() != LockState::Lost {
                        if Instant::now() > deadline {
                            return Err(format!("{name}: the deletion went unnoticed"));
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
                Ok(())
            })
        })
        .collect();
    let failures: Vec<String> = threads
        .into_iter()
        .filter_map(|t| t.join().unwrap().err())
        .collect();
    assert!(failures.is_empty(), "{failures:?}");
}

/// One `Locks`, one name, a local waiter behind the holder (the core's local queue): after a normal
/// release the waiter's hold is told of a deletion, and after the holder's loss the waiter gets a
/// hold that is `Held` (not the lost hold's report), itself told of a later deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_handoffs_carry_the_right_loss_signal() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("h");
    let locks = Locks::new(backend);
    for lose_first in [false, true] {
        let a = locks.lock("h").unwrap().acquire().await.unwrap();
        let lock = locks.lock("h").unwrap();
        let waiting = tokio::spawn(async move { lock.acquire().await });
        tokio::time::sleep(Duration::from_millis(30)).await;
        if lose_first {
            std::fs::remove_file(&path).unwrap();
            tokio::time::timeout(BOUND, a.lost())
                .await
                .expect("a not told");
            let _ = a.release().await;
        } else {
            a.release().await.unwrap();
        }
        let b = tokio::time::timeout(BOUND, waiting)
            .await
            .expect("the local waiter never got the lock")
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            b.state(),
            LockState::Held,
            "lose_first={lose_first}: a false loss"
        );
        std::fs::remove_file(&path).unwrap();
        tokio::time::timeout(BOUND, b.lost())
            .await
            .unwrap_or_else(|_| panic!("lose_first={lose_first}: b not told"));
        let _ = b.release().await;
    }
}

/// One acquire from a runtime without `enable_io` disables inotify for the backend for good
/// (`Notifier::disabled`); every later hold, on ordinary runtimes too, is granted with no watch and
/// so with no loss signal: its deletion is never reported.
#[test]
fn one_acquire_without_io_leaves_later_holds_without_a_loss_signal() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("later");
    let locks = Locks::new(backend);
    let no_io = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    no_io.block_on(async {
        let guard = locks.lock("helper").unwrap().acquire().await.unwrap();
        guard.release().await.unwrap();
    });
    drop(no_io);
    let normal = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    normal.block_on(async {
        let guard = locks.lock("later").unwrap().acquire().await.unwrap();
        std::fs::remove_file(&path).unwrap();
        tokio::time::timeout(BOUND, guard.lost())
            .await
            .expect("a hold on an ordinary runtime is never told of its deletion");
    });
}
