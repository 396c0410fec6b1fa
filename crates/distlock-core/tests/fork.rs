//! The boot-clock timer (`clock::sleep_until`) and `fork` without `exec` (a daemonizing library user, a
//! pre-fork server): the child starts its own runtime and `Locks`, as the file backend's `fork.rs`
//! does. The process's one timer is a `timerfd` read by one thread; a child inherits the record of both
//! but only the descriptor, which still names the parent's timer (a `fork` shares open file
//! descriptions). Each test runs in a process of its own (nextest).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use distlock_core::clock;
use distlock_core::{LockState, Locks, MemoryBackend};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Whether `sleep` woke within `bound` (a tokio timer's; checked first, so a sleep that never woke is
/// not taken as woken when the bound's poll finds its deadline passed).
async fn woke_within(sleep: clock::Sleep, bound: Duration) -> bool {
    tokio::select! {
        biased;
        () = tokio::time::sleep(bound) => false,
        () = sleep => true,
    }
}

/// Waits for the child `pid` (killed after `within`), and returns its exit code.
fn exit_code(pid: libc::pid_t, within: Duration) -> i32 {
    let started = Instant::now();
    let mut status = 0;
    loop {
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if started.elapsed() > within {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            unsafe { libc::waitpid(pid, &mut status, 0) };
            panic!("the forked child hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(libc::WIFEXITED(status), "child status {status}");
    libc::WEXITSTATUS(status)
}

/// The parent slept on the boot clock (so its timer and thread exist), then forks. In the child, a
/// boot-clock sleep must wake, and the watchdog (which sleeps on it until each renewal is due) must
/// keep a 600 ms lease held. Before: the child used the parent's timer, whose thread it does not have:
/// its sleeps never woke, and its holds were never renewed (lost at their deadline, `lost()` never
/// resolving).
#[test]
fn a_forked_child_sleeps_and_renews_on_the_boot_clock() {
    runtime().block_on(clock::sleep(Duration::from_millis(10)));

    // SAFETY: the child only builds a runtime, sleeps, locks in memory, and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = runtime().block_on(async {
            if !woke_within(
                clock::sleep(Duration::from_millis(50)),
                Duration::from_secs(10),
            )
            .await
            {
                return 1;
            }
            let locks = Locks::new(MemoryBackend::new());
            let Ok(guard) = locks
                .lock("forked")
                .unwrap()
                .options()
                .lease(Duration::from_millis(600))
                .acquire()
                .await
            else {
                return 3;
            };
            tokio::time::sleep(Duration::from_secs(2)).await;
            if guard.state() != LockState::Held {
                return 2;
            }
            0
        });
        // SAFETY: leaves the child without running the parent's destructors or test harness.
        unsafe { libc::_exit(code) };
    }
    match exit_code(pid, Duration::from_secs(30)) {
        0 => {}
        1 => panic!("a boot-clock sleep of 50 ms never woke in the forked child"),
        2 => panic!("the forked child's hold was not renewed (its watchdog sleeps never woke)"),
        other => panic!("the forked child failed: {other}"),
    }
}

/// A forked child's sleep must not move the parent's timer: before, the child armed the descriptor it
/// inherited, which is the parent's timer, for its own deadline, and the parent's earlier sleepers
/// (a `lost()`, the watchdog's next renewal) woke only then. Here the parent's 1 s sleep woke at the
/// child's 20 s.
#[test]
fn a_forked_childs_sleep_never_delays_the_parents() {
    // Pending across the fork, so both copies of the timer's record believe it armed for 60 s.
    let mut far = clock::sleep(Duration::from_secs(60));
    runtime().block_on(async {
        assert!(futures_util::poll!(&mut far).is_pending());
    });

    // SAFETY: the child only builds a runtime, polls a sleep once, and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // After the parent armed its 1 s sleep.
        std::thread::sleep(Duration::from_millis(300));
        runtime().block_on(async {
            let mut child = clock::sleep(Duration::from_secs(20));
            let _ = futures_util::poll!(&mut child);
        });
        // SAFETY: leaves the child without running the parent's destructors or test harness.
        unsafe { libc::_exit(0) };
    }
    let started = Instant::now();
    runtime().block_on(async {
        let near = clock::sleep(Duration::from_secs(1));
        // Far below the child's 20 s.
        assert!(
            woke_within(near, Duration::from_secs(9)).await,
            "the parent's 1 s sleep must wake in time, whatever a forked child sleeps"
        );
    });
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(exit_code(pid, Duration::from_secs(30)), 0);
    drop(far);
}
