//! Where the file backend's inotify reader runs: never on a runtime that would make tokio panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distlock_core::Locks;
use distlock_file::FileBackend;

/// A multi-thread runtime without `enable_io` acquires: the inotify reader goes on distlock's background
/// runtime with no panic inside distlock (a review of a reader put on the caller's multi-thread runtime
/// first: tokio's "IO is disabled" panic, caught, still ran the process's panic hook, and under
/// `panic = "abort"` it would abort the process), and a deletion is still reported.
#[test]
fn a_multi_thread_runtime_without_io_makes_no_panic() {
    let panics = Arc::new(AtomicUsize::new(0));
    let counted = panics.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        counted.fetch_add(1, Ordering::SeqCst);
        previous(info);
    }));
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("no-io");
    let locks = Locks::new(backend);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let guard = locks.lock("no-io").unwrap().acquire().await.unwrap();
        std::fs::remove_file(&path).unwrap();
        tokio::time::timeout(Duration::from_secs(5), guard.lost())
            .await
            .expect("never reported");
    });
    let _ = std::panic::take_hook();
    assert_eq!(
        panics.load(Ordering::SeqCst),
        0,
        "acquiring on a multi-thread runtime without I/O panicked inside distlock (caught); with panic=abort this aborts the process"
    );
}
