//! The per-process sync thread and `fork` without `exec`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use distlock_core::Locks;
use distlock_file::FileBackend;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A process that used the file backend (so the sync thread exists, idle) forks without exec (a
/// daemonizing library user, a pre-fork server); the child starts its own runtime and backend and
/// acquires a free lock. The sync thread is not in the child, but its record is: without the check of
/// the process id, the sync was handed to a slot nobody reads, the acquire never completed, and a
/// timed-out acquire left the job (and the locked file in it) in the slot, the lock held by the child
/// until it exited.
#[test]
fn a_forked_child_can_acquire_with_sync() {
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let locks = Locks::new(FileBackend::new(dir.path()).unwrap());
        let guard = locks.lock("parent").unwrap().acquire().await.unwrap();
        guard.release().await.unwrap();
    });
    // Let the sync thread go back to waiting (its `busy` flag cleared).
    std::thread::sleep(Duration::from_millis(100));

    // SAFETY: the child only builds a runtime, acquires, and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = runtime().block_on(async {
            let locks = Locks::new(FileBackend::new(dir.path()).unwrap());
            let lock = locks.lock("child").unwrap();
            match tokio::time::timeout(Duration::from_secs(3), lock.acquire()).await {
                Ok(Ok(guard)) => {
                    guard.release().await.unwrap();
                    0
                }
                Ok(Err(_)) => 3,
                Err(_) => {
                    // Timed out: is the lock left held behind the dropped acquire?
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let other = Locks::new(FileBackend::new(dir.path()).unwrap());
                    match other.lock("child").unwrap().try_acquire().await {
                        Ok(Some(_)) => 1,
                        _ => 2,
                    }
                }
            }
        });
        unsafe { libc::_exit(code) };
    }
    let started = Instant::now();
    let mut status = 0;
    loop {
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if started.elapsed() > Duration::from_secs(20) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
            unsafe { libc::waitpid(pid, &mut status, 0) };
            panic!("the forked child hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(libc::WIFEXITED(status), "child status {status}");
    match libc::WEXITSTATUS(status) {
        0 => {}
        1 => panic!("the forked child's acquire of a free lock never completed (sync handed to a thread the child does not have)"),
        2 => panic!("the forked child's acquire never completed, and its timed-out acquire left the lock held"),
        other => panic!("the forked child failed: {other}"),
    }
}
