//! Acquiring: one try (open, `flock` without blocking, mint the token, make it durable) and the wait
//! between tries (inotify, or the fallback poll).

use std::path::Path;
use std::sync::Arc;

use distlock_core::raw::{AcquireRequest, Attempt, Grant, LossReport};
use distlock_core::retry::Backoff;
use distlock_core::{FencingToken, Result};

use crate::config::FileConfig;
use crate::error::FileError;
use crate::held::{FileLease, HeldFile};
use crate::notify::{Notifier, Shared, Subscription};
use crate::open::OpenFile;
use crate::sync_thread::off_the_workers_in;

/// How many times one try starts over because the lock file was deleted or replaced under it.
const MAX_ROUNDS: usize = 8;

/// One acquire under way: the open lock file (kept between tries), its watch, and the poll's backoff.
#[derive(Debug)]
pub struct FileAcquisition {
    /// Shared with the hold and its loss signal, not copied into each (issue 9: allocations).
    path: Arc<Path>,
    file: Option<OpenFile>,
    watch: Option<Subscription>,
    watch_failed: bool,
    backoff: Backoff,
}

/// One try (inline: microseconds). Borrows the names it needs; its outcome goes back into the
/// acquisition.
struct TryJob<'a> {
    path: &'a Arc<Path>,
    dir: &'a Path,
    owner: &'a str,
    file: Option<OpenFile>,
    watch: Option<Subscription>,
    watcher: Option<Arc<Shared>>,
    watch_failed: bool,
}

enum TryOutcome {
    Acquired {
        held: HeldFile,
        first_token: bool,
        watch: Option<Subscription>,
    },
    Busy {
        file: OpenFile,
        watch: Option<Subscription>,
        watch_failed: bool,
    },
}

impl TryJob<'_> {
    fn run(mut self) -> Result<TryOutcome, FileError> {
        for _ in 0..MAX_ROUNDS {
            let mut file = match self.file.take() {
                Some(file) => file,
                None => {
                    // A new file: a watch of the old one is useless.
                    self.watch = None;
                    OpenFile::open(self.path, self.dir)?
                }
            };
            let locked = file.try_lock(self.path)?;
            let fresh_watch = self.watch.is_none() && self.subscribe();
            // The watch follows the path, the lock the descriptor: both must be on the same file.
            if !file.is_current(self.path)? {
                tracing::debug!(path = %self.path.display(), "lock file replaced under a try; reopening");
                self.watch = None;
                continue;
            }
            if locked {
                let (held, first_token) = HeldFile::take(file, self.path, self.owner)?;
                return Ok(TryOutcome::Acquired {
                    held,
                    first_token,
                    watch: self.watch,
                });
            }
            if fresh_watch {
                // Busy before the watch existed: a release in between raised no event, so look again.
                self.file = Some(file);
                continue;
            }
            return Ok(TryOutcome::Busy {
                file,
                watch: self.watch,
                watch_failed: self.watch_failed,
            });
        }
        Err(FileError::Replaced {
            path: self.path.to_path_buf(),
        })
    }

    /// Adds the watch; `true` if one was added now.
    fn subscribe(&mut self) -> bool {
        if self.watch_failed {
            return false;
        }
        let Some(watcher) = &self.watcher else {
            return false;
        };
        match watcher.subscribe(self.path) {
            Ok(watch) => {
                self.watch = Some(watch);
                true
            }
            // The file was unlinked since the try opened it: the try reopens it and watches again.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot watch the lock file; waiting by polling only");
                self.watch_failed = true;
                false
            }
        }
    }
}

impl FileAcquisition {
    /// An acquire of the lock file at `path`; nothing is opened yet.
    pub(crate) fn new(path: impl Into<Arc<Path>>, config: &FileConfig) -> Self {
        Self {
            path: path.into(),
            file: None,
            watch: None,
            watch_failed: false,
            backoff: Backoff::new(config.poll_initial, config.poll_max),
        }
    }

    /// One try. `watcher` gives the inotify instance to watch the file with (none if notification is
    /// off); it is not asked again once a watch failed.
    ///
    /// # Cancel safety
    /// The only await is the `fdatasync` off the runtime's workers, which finishes even if this future is
    /// dropped; the locked file is then dropped with its result, which clears the record and unlocks.
    pub(crate) async fn try_once(
        &mut self,
        config: &FileConfig,
        watcher: impl FnOnce() -> Option<Arc<Shared>>,
        notifier: &Arc<Notifier>,
        request: &AcquireRequest,
    ) -> Result<Attempt<FileLease>> {
        let job = TryJob {
            path: &self.path,
            dir: &config.dir,
            owner: &request.owner,
            file: self.file.take(),
            watch: self.watch.take(),
            watcher: if self.watch_failed { None } else { watcher() },
            watch_failed: self.watch_failed,
        };
        let outcome = job.run().map_err(|e| e.into_core(Some(&request.name)))?;
        match outcome {
            TryOutcome::Acquired {
                mut held,
                first_token,
                watch,
            } => {
                if config.sync {
                    // The directory too for a file's first token only (the path is needed then alone).
                    let dir = first_token.then(|| config.dir.clone());
                    let pid = held.pid;
                    held = off_the_workers_in(pid, move || held.sync(dir.as_deref()))
                        .await
                        .and_then(|r| r)
                        .map_err(|e| e.into_core(Some(&request.name)))?;
                }
                grant(held, watch, notifier, request).map(Attempt::Acquired)
            }
            TryOutcome::Busy {
                file,
                watch,
                watch_failed,
            } => {
                self.file = Some(file);
                self.watch = watch;
                self.watch_failed = watch_failed;
                Ok(Attempt::Busy { retry_after: None })
            }
        }
    }

    /// Waits for an inotify event on the lock file or the fallback timer, whichever is first.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits. Events that arrive meanwhile are kept for the next wait.
    pub(crate) async fn wait(&mut self) {
        // The poll's delay doubles after every wait the timer ends (up to `poll_max`) and starts over
        // after an event. A lost watch ends the wait at once, before any poll: it leaves the delay as it
        // was (the backoff is restored), so it does not stretch the next poll with no time passed.
        let before = self.backoff.clone();
        let delay = self.backoff.next_delay();
        let event = match self.watch.as_mut() {
            Some(watch) => tokio::select! {
                alive = watch.changed() => Some(alive),
                () = tokio::time::sleep(delay) => None,
            },
            None => {
                tokio::time::sleep(delay).await;
                None
            }
        };
        match event {
            Some(true) => self.backoff.reset(),
            // The watch is gone (the file was deleted, or the reader stopped): the next try reopens
            // the path and watches it again.
            Some(false) => {
                self.watch = None;
                self.backoff = before;
            }
            None => {}
        }
    }
}

/// The grant of a held (and, if configured, synced) lock file: its token, its descriptor for
/// `inheritable_descriptor`, and the loss signal if the file is watched (the notifier keeps the
/// hold's record and reports into it: no task per hold).
fn grant(
    mut held: HeldFile,
    watch: Option<Subscription>,
    notifier: &Arc<Notifier>,
    request: &AcquireRequest,
) -> Result<Grant<FileLease>> {
    let token = held.token;
    // The locked descriptor itself, not a `dup` of it: whoever inherits it keeps the lock held (it
    // is close-on-exec, so only a deliberate hand-over passes it on). See `OpenFile::fd`.
    let descriptor = held.file.fd.clone();
    // Every grant gets a loss signal, watched or not: without a watch the notifier's keeper watches
    // the file later or checks it every second.
    let report = LossReport::new();
    let inode = (held.file.dev, held.file.ino);
    held.watching = Some(notifier.watch_held(watch, held.path.clone(), inode, report.clone()));
    let loss = report.signal();
    tracing::debug!(lock = %request.name, token, "file lock acquired");
    let mut grant = Grant::new(FileLease::new(held)).with_token(FencingToken::new(token));
    grant.descriptor = Some(descriptor);
    grant = grant.with_loss(loss);
    Ok(grant)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Duration;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A watch made on a runtime that is then dropped.
    fn watch_from_a_dropped_runtime(notifier: &Arc<Notifier>, path: &Path) -> Subscription {
        let first = runtime();
        let watch = first.block_on(async { notifier.instance().unwrap().subscribe(path).unwrap() });
        drop(first);
        watch
    }

    /// The grant's inheritable descriptor is the descriptor the lease locked and releases (one open
    /// descriptor per hold, no `dup` per acquisition), and the file stays open while the core keeps
    /// it: releasing through the lease unlocks it for the holder of the descriptor too.
    #[test]
    fn the_grant_shares_the_locked_descriptor() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let config = FileConfig::new(dir.path());
        let path = dir.path().join("x.lock");
        let notifier = Arc::new(Notifier::default());
        let request = AcquireRequest::new("x", "owner-1", Duration::from_secs(30));
        let mut acquisition = FileAcquisition::new(path.clone(), &config);
        let attempt = runtime()
            .block_on(acquisition.try_once(&config, || None, &notifier, &request))
            .unwrap();
        let Attempt::Acquired(grant) = attempt else {
            panic!("a free lock file was busy");
        };
        let descriptor = grant
            .descriptor
            .clone()
            .expect("a file grant has a descriptor");
        let held = grant.lease.take().expect("the lease holds the file");
        assert!(
            Arc::ptr_eq(&descriptor, &held.file.fd),
            "the grant's descriptor {} is not the locked one {}",
            descriptor.as_raw_fd(),
            held.file.fd.as_raw_fd()
        );
        drop(grant);
        assert_eq!(
            held.release("owner-1"),
            distlock_core::raw::Released::Released
        );
        // Released through the lease: another open file description can lock it, while the
        // descriptor the core keeps stays open.
        let other = std::fs::File::open(&path).unwrap();
        rustix::fs::flock(&other, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .expect("the released file is still locked");
        assert!(rustix::io::fcntl_getfd(&*descriptor).is_ok());
    }

    /// A watch that ends (its reader stopped, or the file went) makes the wait return at once, without
    /// sleeping; the fallback poll must not grow then, or every lost watch would stretch the next
    /// poll without any time having passed.
    #[test]
    fn a_lost_watch_does_not_grow_the_poll() {
        let dir = tempfile::tempdir().unwrap();
        let config = FileConfig::new(dir.path());
        let path = dir.path().join("x.lock");
        std::fs::write(&path, b"").unwrap();
        let notifier = Arc::new(Notifier::default());
        let mut acquisition = FileAcquisition::new(path.clone(), &config);
        // The file deleted: the kernel drops the watch, and the watch ends.
        let mut watch = notifier.instance().unwrap().subscribe(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        runtime().block_on(async {
            let ended = async { while watch.changed().await {} };
            tokio::time::timeout(Duration::from_secs(2), ended)
                .await
                .expect("the deleted file's watch did not end");
        });
        acquisition.watch = Some(watch);
        runtime()
            .block_on(async {
                tokio::time::timeout(Duration::from_millis(10), acquisition.wait()).await
            })
            .expect("a lost watch ends the wait at once");
        assert!(acquisition.watch.is_none());
        assert_eq!(acquisition.backoff.nominal(), config.poll_initial);
    }

    /// The runtime that first asked for the inotify instance is dropped (here before its reader
    /// could ever have run on it): the instance's reader runs on distlock's background runtime, so
    /// a watch made then still gets events, and the next runtime shares the instance.
    #[test]
    fn the_instance_outlives_the_runtime_that_started_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.lock");
        std::fs::write(&path, b"").unwrap();
        let notifier = Arc::new(Notifier::default());
        let mut early = watch_from_a_dropped_runtime(&notifier, &path);
        runtime().block_on(async {
            let mut fresh = notifier.instance().unwrap().subscribe(&path).unwrap();
            drop(std::fs::OpenOptions::new().write(true).open(&path).unwrap());
            for (name, watch) in [("early", &mut early), ("fresh", &mut fresh)] {
                let woken = tokio::time::timeout(Duration::from_secs(2), watch.changed()).await;
                assert_eq!(
                    woken,
                    Ok(true),
                    "a close raised no event on the {name} watch"
                );
            }
        });
    }
}
