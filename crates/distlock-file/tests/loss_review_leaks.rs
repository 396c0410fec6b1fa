//! Adversarial review: the notifier's watches and instances do not outlive the holds (one test per
//! process, since it counts the process's inotify watches).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use distlock_core::Locks;
use distlock_file::FileBackend;

/// `(inotify instances, watches)` open in this process, from /proc/self/fd and fdinfo.
fn inotify_usage() -> (usize, usize) {
    let (mut instances, mut watches) = (0, 0);
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if target.to_string_lossy() != "anon_inode:inotify" {
            continue;
        }
        instances += 1;
        let info = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            entry.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        watches += info
            .lines()
            .filter(|l| l.starts_with("inotify wd:"))
            .count();
    }
    (instances, watches)
}

/// Acquire/release/drop churn across runtimes that are dropped with guards alive, guards dropped
/// later, deletions reported: afterwards no watch is left and the instances are bounded.
#[test]
fn churn_across_dropped_runtimes_leaves_no_watch() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let paths = FileBackend::new(dir.path()).unwrap();
    let locks = Locks::new(backend);
    let mut max_instances = 0;
    for round in 0..60 {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let kept: Vec<_> = runtime.block_on(async {
            let mut kept = Vec::new();
            for i in 0..6 {
                let name = format!("c{}", (round + i) % 9);
                let Ok(Some(guard)) = locks.lock(&name).unwrap().try_acquire().await else {
                    continue;
                };
                match i % 3 {
                    0 => guard.release().await.unwrap(),
                    1 => drop(guard),
                    _ => kept.push((name, guard)),
                }
            }
            kept
        });
        drop(runtime);
        // Half of the kept holds lose their file, then all are dropped with no runtime about.
        for (n, (name, guard)) in kept.into_iter().enumerate() {
            if n % 2 == 0 {
                let _ = std::fs::remove_file(paths.lock_file(&name));
                let deadline = Instant::now() + Duration::from_secs(5);
                while guard.state() != distlock_core::LockState::Lost {
                    assert!(
                        Instant::now() < deadline,
                        "round {round}: {name} not reported"
                    );
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            drop(guard);
        }
        max_instances = max_instances.max(inotify_usage().0);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (instances, watches) = inotify_usage();
        if watches == 0 && instances <= 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{instances} inotify instances with {watches} watches left after every hold ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        max_instances <= 3,
        "{max_instances} inotify instances at once"
    );

    // The count sees a held file's watch: one hold outliving its runtime is watched again (by the
    // keeper), and its watch goes with it.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let guard = runtime.block_on(async { locks.lock("last").unwrap().acquire().await.unwrap() });
    drop(runtime);
    let deadline = Instant::now() + Duration::from_secs(5);
    while inotify_usage().1 == 0 {
        assert!(
            Instant::now() < deadline,
            "the held file is not watched again"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(guard);
    let deadline = Instant::now() + Duration::from_secs(5);
    while inotify_usage().1 != 0 {
        assert!(Instant::now() < deadline, "a dropped hold's watch stays");
        std::thread::sleep(Duration::from_millis(10));
    }
}
