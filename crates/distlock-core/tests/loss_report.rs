//! A backend's [`LossReport`]: reported after the grant, before the core installed it, or after the
//! hold ended, the guard sees exactly the loss of its own hold, with no task per hold.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, Grant, LossReport, Released, Renewal, RenewalId, Renewed,
};
use distlock_core::{Capabilities, ErrorKind, LockState, Locks, Result};

/// Grants every acquire (names are not shared between tests) and keeps each grant's report.
#[derive(Clone, Default)]
struct Reporting {
    reports: Arc<Mutex<Vec<LossReport>>>,
    /// Report a loss inside `try_acquire`, before the core has the grant.
    report_at_grant: Arc<Mutex<Option<String>>>,
    /// One report for every grant (a report per session), instead of one per grant.
    shared: Option<LossReport>,
    /// Every release answers `Unavailable` (its reply was lost: outcome unknown).
    release_unknown: bool,
}

impl Reporting {
    fn last(&self) -> LossReport {
        self.reports
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("a grant")
    }
}

#[async_trait]
impl Backend for Reporting {
    type Lease = ();
    type Acquisition = ();

    fn kind(&self) -> &'static str {
        "reporting"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::mutex()
    }

    fn begin(&self, _request: &AcquireRequest) -> Result<()> {
        Ok(())
    }

    async fn try_acquire(&self, _: &mut (), _request: &AcquireRequest) -> Result<Attempt<()>> {
        let report = self.shared.clone().unwrap_or_default();
        if let Some(reason) = self.report_at_grant.lock().unwrap().take() {
            report.report(reason);
        }
        self.reports.lock().unwrap().push(report.clone());
        Ok(Attempt::Acquired(Grant::new(()).with_loss(report.signal())))
    }

    async fn wait(&self, _: &mut (), _: &AcquireRequest, _: Option<Duration>) -> Result<()> {
        std::future::pending().await
    }

    async fn abandon(&self, _: (), _: &AcquireRequest) {}

    async fn renew(&self, _batch: &[Renewal<'_, ()>]) -> Vec<(RenewalId, Result<Renewed>)> {
        Vec::new()
    }

    async fn release(&self, _: &(), _: &str, _: &str) -> Result<Released> {
        if self.release_unknown {
            return Err(distlock_core::Error::new(
                ErrorKind::Unavailable,
                "the release got no answer: outcome unknown",
            ));
        }
        Ok(Released::Released)
    }
}

/// A release whose outcome is unknown stays `Unavailable` even when the hold was already reported
/// lost: the server may still hold it (a client-side deadline passes before the server's expiry), so
/// `NotHeld`, a definite answer, would be false. (A core rule that turned it into `NotHeld` was tried
/// and reverted: a deadline passing during the release made `distlock run` exit 76 for a command that
/// ran under the lock.)
#[tokio::test]
async fn an_unknown_release_outcome_stays_unavailable_even_after_a_reported_loss() {
    let backend = Reporting {
        release_unknown: true,
        ..Reporting::default()
    };
    let locks = Locks::new(backend.clone());
    let guard = locks.lock("unknown-held").unwrap().acquire().await.unwrap();
    let err = guard.release().await.expect_err("an unknown outcome");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let guard = locks.lock("unknown-lost").unwrap().acquire().await.unwrap();
    backend.last().report("the lease expired while cut off");
    let err = guard.release().await.expect_err("lost before the release");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}

#[tokio::test]
async fn a_report_after_the_grant_makes_the_guard_lost_at_once() {
    let backend = Reporting::default();
    let locks = Locks::new(backend.clone());
    let guard = locks.lock("a").unwrap().acquire().await.unwrap();
    let mut changes = guard.state_changes();
    assert_eq!(*changes.borrow(), LockState::Held);
    backend.last().report("the key was deleted");
    // Synchronous: no task has to run for the guard to know.
    assert_eq!(guard.loss_reason().as_deref(), Some("the key was deleted"));
    assert!(changes.has_changed().unwrap(), "the state channel was told");
    assert_eq!(*changes.borrow_and_update(), LockState::Lost);
    // The lock has no deadline: only the report can have ended it.
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("lost() resolves on the report");
    // The first reason wins.
    backend.last().report("a second reason");
    assert_eq!(guard.loss_reason().as_deref(), Some("the key was deleted"));
}

#[tokio::test]
async fn a_report_before_the_core_installs_the_grant_is_not_missed() {
    let backend = Reporting::default();
    *backend.report_at_grant.lock().unwrap() = Some("the session ended during the grant".into());
    let locks = Locks::new(backend.clone());
    let guard = locks.lock("b").unwrap().acquire().await.unwrap();
    assert_eq!(
        guard.loss_reason().as_deref(),
        Some("the session ended during the grant")
    );
}

#[tokio::test]
async fn a_report_after_the_release_touches_neither_that_hold_nor_the_next() {
    let backend = Reporting::default();
    let locks = Locks::new(backend.clone());
    let lock = locks.lock("c").unwrap();
    let first = lock.acquire().await.unwrap();
    let old = backend.last();
    first.release().await.unwrap();
    let second = lock.acquire().await.unwrap();
    old.report("the first hold's key was deleted");
    assert_eq!(
        second.loss_reason(),
        None,
        "the next hold is not the reported one"
    );
    assert_eq!(*second.state_changes().borrow(), LockState::Held);
    // The report does not keep a dropped hold alive: reporting into it is a no-op.
    drop(second);
    backend.last().report("after the drop");
}

/// One report's signal given to several grants (a report per session) reaches every one of them,
/// and a hold granted after the report is `Lost` at once (review: only the hold attached last was).
#[tokio::test]
async fn a_report_shared_by_several_grants_reaches_every_hold() {
    let backend = Reporting {
        shared: Some(LossReport::new()),
        ..Reporting::default()
    };
    let locks = Locks::new(backend.clone());
    let a = locks.lock("a").unwrap().acquire().await.unwrap();
    let b = locks.lock("b").unwrap().acquire().await.unwrap();
    let ended = locks.lock("ended").unwrap().acquire().await.unwrap();
    ended.release().await.unwrap();
    backend.last().report("the session is gone");
    assert_eq!(a.state(), LockState::Lost, "the first hold is told too");
    assert_eq!(b.state(), LockState::Lost);
    let later = locks.lock("later").unwrap().acquire().await.unwrap();
    assert_eq!(later.loss_reason().as_deref(), Some("the session is gone"));
}
