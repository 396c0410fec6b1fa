//! Where an acquire's `fdatasync` runs: on one thread per process kept for it, or on tokio's blocking
//! pool when that thread is busy.
//!
//! Why not a `spawn_blocking` per acquire: it allocates a task, takes the pool's mutex (which the woken
//! pool thread then contends for) and parks that thread with a timed wait afterwards; a job handed to
//! a thread already waiting for it costs one wake-up (issue 9). Why not inline on the
//! runtime worker: a sync waits for the device (0.1 ms to several ms here), and every other task of
//! that worker would wait with it. The thread runs one sync at a time; a sync asked for while it is
//! busy goes to the blocking pool, so concurrent acquires (of one `Locks` or of several) still sync in
//! parallel and the device can merge their flushes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use tokio::sync::oneshot;

use crate::error::FileError;

type Job = Box<dyn FnOnce() + Send>;

/// The thread's one job slot. A mutex and a condition variable, not a channel: std's channel spins
/// before it parks, and the thread parks after every sync.
struct SyncThread {
    job: Arc<(Mutex<Option<Job>>, Condvar)>,
    /// Set by whoever hands the thread a job (so the slot is free), cleared by the thread once it ran it.
    busy: Arc<AtomicBool>,
    /// The process that started the thread. A child forked without exec inherits this record but not
    /// the thread: a job put in the slot there would never run (the acquire would hang, and one cut
    /// short by its wait limit would leave the file locked), so a child syncs on the pool. One
    /// `getpid` per sync, against an `fdatasync`.
    pid: u32,
}

fn slot(job: &Mutex<Option<Job>>) -> MutexGuard<'_, Option<Job>> {
    // An `Option` cannot be left half-written by a panic.
    job.lock().unwrap_or_else(|p| p.into_inner())
}

fn sync_thread() -> Option<&'static SyncThread> {
    static THREAD: OnceLock<Option<SyncThread>> = OnceLock::new();
    THREAD
        .get_or_init(|| {
            let job = Arc::new((Mutex::new(None::<Job>), Condvar::new()));
            let busy = Arc::new(AtomicBool::new(false));
            let (queue, idle) = (job.clone(), busy.clone());
            let spawned = std::thread::Builder::new()
                .name("distlock-file-sync".into())
                .spawn(move || loop {
                    let next = {
                        let mut waiting = slot(&queue.0);
                        loop {
                            if let Some(next) = waiting.take() {
                                break next;
                            }
                            waiting = queue.1.wait(waiting).unwrap_or_else(|p| p.into_inner());
                        }
                    };
                    // A job that panics (it should not) must not end the thread with `busy` set.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(next)).is_err() {
                        tracing::warn!("a file lock sync job panicked");
                    }
                    idle.store(false, Ordering::Release);
                });
            match spawned {
                Ok(_) => Some(SyncThread {
                    job,
                    busy,
                    pid: std::process::id(),
                }),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start the file lock sync thread; syncing on tokio's blocking pool");
                    None
                }
            }
        })
        .as_ref()
}

/// [`off_the_workers_in`] for this process (tests: the acquire passes the id it read already).
#[cfg(test)]
pub(crate) async fn off_the_workers<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, FileError> {
    off_the_workers_in(std::process::id(), work).await
}

/// Runs `work` (an `fdatasync`, milliseconds at worst) off the runtime's workers: on the sync thread
/// if it is idle, else on tokio's blocking pool; inline when there is no runtime. If the caller's
/// future is dropped, the work still finishes and its result is dropped where it ran, which undoes it
/// (see `HeldFile`'s `Drop`). `pid` is this process's id, read by the caller during this acquire (the
/// record names it already: one `getpid` per acquire, not two); the sync thread serves only the
/// process that started it.
pub(crate) async fn off_the_workers_in<T: Send + 'static>(
    pid: u32,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, FileError> {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return Ok(work());
    };
    let (done, result) = oneshot::channel();
    let job: Job = Box::new(move || {
        // A dropped receiver hands the result back, to be dropped here.
        let _ = done.send(work());
    });
    match sync_thread() {
        Some(thread) if thread.pid == pid && !thread.busy.swap(true, Ordering::Acquire) => {
            *slot(&thread.job.0) = Some(job);
            thread.job.1.notify_one();
        }
        _ => drop(runtime.spawn_blocking(job)),
    }
    result
        .await
        .map_err(|_| FileError::Task("the sync did not report back".into()))
}

/// The sync slot under load and after a panicking job.
#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Many jobs at once from tasks of two runtimes (handed to the thread as it finishes the previous
    /// one, or to the pool): every one reports back.
    #[test]
    fn every_job_reports_back_under_contention() {
        let runtimes: Vec<_> = (0..2)
            .map(|_| {
                std::thread::spawn(|| {
                    let rt = tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .enable_all()
                        .build()
                        .unwrap();
                    rt.block_on(async {
                        let tasks: Vec<_> = (0..16)
                            .map(|t| {
                                tokio::spawn(async move {
                                    for i in 0..2000u64 {
                                        let got = tokio::time::timeout(
                                            Duration::from_secs(10),
                                            off_the_workers(move || t * 100_000 + i),
                                        )
                                        .await
                                        .expect("a job never reported back")
                                        .unwrap();
                                        assert_eq!(got, t * 100_000 + i);
                                    }
                                })
                            })
                            .collect();
                        for t in tasks {
                            t.await.unwrap();
                        }
                    });
                })
            })
            .collect();
        for r in runtimes {
            r.join().unwrap();
        }
    }

    /// A job that panics on the sync thread ends it; later jobs must still run (on the pool).
    #[test]
    fn a_panicking_job_does_not_stop_later_syncs() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // Make sure the first goes to the thread: nothing else runs in this test process.
            let err = off_the_workers(|| -> u32 { panic!("boom") }).await;
            assert!(err.is_err());
            for i in 0..100u32 {
                let got = tokio::time::timeout(Duration::from_secs(5), off_the_workers(move || i))
                    .await
                    .expect("a job after the panic never reported back")
                    .unwrap();
                assert_eq!(got, i);
            }
        });
    }
}
