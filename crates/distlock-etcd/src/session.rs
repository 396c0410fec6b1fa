//! Sessions: one etcd lease per distinct TTL per backend, like Go's `concurrency.Session`. Every lock
//! key hangs on its session's lease, so an acquire is one transaction and a renewal is one keep-alive
//! round trip per session, however many locks it carries.
//!
//! A session keeps itself alive from a task of its own every third of its TTL (as Go does), because
//! queued keys of waiters hang on it too and the core's watchdog renews only held locks. The core's
//! renewals go through [`Session::keep_alive`] as well, so each renewal is confirmed by a round trip
//! sent after the core read its clock, and the validity deadline it computes is sound.
//!
//! Keep-alives on one session are serialised on one stream, and a stream that failed or timed out is
//! dropped rather than reused: a late reply read as the answer to a newer request would overstate the
//! lease.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::rpc::pb::etcdserverpb::LeaseGrantResponse;
use crate::rpc::{Client, KeepAliveStream};
use distlock_core::clock::{self, Instant};
use distlock_core::retry::Backoff;
use tokio::sync::watch;

use crate::error::EtcdError;
use crate::expiry::Expiries;

/// Why a keep-alive did not confirm the lease.
#[derive(Debug)]
pub(crate) enum KeepAlive {
    /// The server says the lease is gone (expired or revoked): final.
    Gone(String),
    /// Unknown (no answer, connection down).
    Failed(EtcdError),
}

/// What was last confirmed about the lease.
#[derive(Debug, Clone, Copy)]
struct Confirmed {
    /// When the request that confirmed it was sent.
    sent: Instant,
    /// The TTL it was refreshed to.
    ttl: Duration,
}

/// One session lease and its keep-alive stream.
pub(crate) struct Session {
    pub(crate) id: i64,
    /// The TTL the server granted (at least what was asked: etcd raises short TTLs to its minimum).
    pub(crate) granted: Duration,
    /// The backend's connection; replaced when the runtime it was made on is dropped.
    client: Mutex<Client>,
    timeout: Duration,
    confirmed: Mutex<Confirmed>,
    stream: tokio::sync::Mutex<Option<KeepAliveStream>>,
    gone: watch::Sender<Option<String>>,
    /// The backend's held-lock deadlines, which list every hold on this session: marking the session
    /// gone reports each of them lost ([`Expiries::session_gone`]), with no task per hold.
    holds: Weak<Expiries>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &format_args!("{:x}", self.id))
            .field("granted", &self.granted)
            .field("gone", &*self.gone.borrow())
            .finish_non_exhaustive()
    }
}

impl Session {
    /// The session of a lease granted by `resp` (asked for `secs`), whose request was sent at `sent`.
    pub(crate) fn granted(
        client: &Client,
        secs: i64,
        resp: LeaseGrantResponse,
        sent: Instant,
        timeout: Duration,
        holds: Weak<Expiries>,
    ) -> Result<Arc<Session>, EtcdError> {
        if !resp.error.is_empty() || resp.ttl <= 0 {
            return Err(EtcdError::Protocol(format!(
                "lease grant of {secs}s answered ttl {} error {:?}",
                resp.ttl, resp.error
            )));
        }
        let granted = Duration::from_secs(resp.ttl.unsigned_abs());
        let session = Arc::new(Session {
            id: resp.id,
            granted,
            client: Mutex::new(client.clone()),
            timeout,
            confirmed: Mutex::new(Confirmed { sent, ttl: granted }),
            stream: tokio::sync::Mutex::new(None),
            gone: watch::channel(None).0,
            holds,
        });
        tracing::debug!(lease = %format_args!("{:x}", session.id), ?granted, "etcd session granted");
        Ok(session)
    }

    /// The connection to use now.
    fn client(&self) -> Client {
        match self.client.lock() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Moves the session to a new connection (the old one died with its runtime): the keep-alive
    /// stream, opened on the old one, is dropped and reopened on the next keep-alive.
    pub(crate) async fn use_client(&self, client: &Client) {
        let mut stream = self.stream.lock().await;
        *stream = None;
        if let Ok(mut c) = self.client.lock() {
            *c = client.clone();
        }
    }

    /// Runs the session's own keep-alives until it is gone (or the task is aborted with the backend).
    pub(crate) async fn keep_alive_loop(self: Arc<Self>) {
        let interval = (self.granted / 3).max(Duration::from_millis(100));
        // A failed keep-alive is retried four times per interval (jittered), so that a few failures in
        // a row still leave the lease confirmed well within its TTL.
        let retry = (interval / 4).max(Duration::from_millis(50));
        let mut backoff = Backoff::new(retry, retry);
        let mut next = interval;
        loop {
            // On the boot clock: after a suspend the keep-alive goes out at the resume, while the
            // lease may still live (the server counted the suspend), not as much later.
            clock::sleep(next).await;
            match self.keep_alive().await {
                Ok(_) => next = interval,
                Err(KeepAlive::Gone(_)) => return,
                Err(KeepAlive::Failed(e)) => {
                    tracing::debug!(lease = %format_args!("{:x}", self.id), error = %e, "etcd keep-alive failed; retrying");
                    next = backoff.next_delay();
                }
            }
        }
    }

    /// One keep-alive round trip. `Ok(ttl)`: the lease was refreshed to `ttl` after this call began.
    pub(crate) async fn keep_alive(&self) -> Result<Duration, KeepAlive> {
        if let Some(reason) = self.gone_reason() {
            return Err(KeepAlive::Gone(reason));
        }
        let mut stream = self.stream.lock().await;
        let sent = clock::now();
        // A keep-alive later than a third of the TTL is of little use; do not wait longer.
        let bound = self
            .timeout
            .min((self.granted / 3).max(Duration::from_millis(300)));
        let round_trip = async {
            let reply = match stream.as_mut() {
                // Opening the stream sends the first keep-alive; its reply says whether the lease lives.
                None => {
                    let (opened, first) = self.client().lease_keep_alive(self.id).await?;
                    *stream = Some(opened);
                    Some(first)
                }
                Some(open) => open.keep_alive().await?,
            };
            Ok(reply.map(|r| Duration::from_secs(r.ttl.max(0).unsigned_abs())))
        };
        let outcome: Result<Option<Duration>, tonic::Status> =
            match tokio::time::timeout(bound, round_trip).await {
                Ok(outcome) => outcome,
                Err(_) => {
                    *stream = None;
                    return Err(KeepAlive::Failed(EtcdError::Timeout {
                        action: "keep-alive",
                        after: bound,
                    }));
                }
            };
        match outcome {
            Ok(Some(ttl)) if !ttl.is_zero() => {
                if let Ok(mut c) = self.confirmed.lock() {
                    *c = Confirmed { sent, ttl };
                }
                Ok(ttl)
            }
            Ok(Some(_)) => {
                *stream = None;
                Err(self.mark_gone("the session lease expired or was revoked on the server"))
            }
            Ok(None) => {
                *stream = None;
                Err(KeepAlive::Failed(EtcdError::Protocol(
                    "the keep-alive stream closed".into(),
                )))
            }
            Err(e) => {
                *stream = None;
                Err(KeepAlive::Failed(EtcdError::Rpc {
                    action: "keep-alive",
                    source: e,
                }))
            }
        }
    }

    /// Time left on the lease as last confirmed, counted from when the confirming request was sent
    /// (so never more than the server's).
    pub(crate) fn remaining(&self) -> Duration {
        let c = match self.confirmed.lock() {
            Ok(c) => *c,
            Err(_) => return Duration::ZERO,
        };
        c.ttl
            .saturating_sub(clock::now().saturating_duration_since(c.sent))
    }

    pub(crate) fn mark_gone(&self, reason: &str) -> KeepAlive {
        let reason = format!("{reason} (lease {:x})", self.id);
        self.gone.send_if_modified(|g| {
            if g.is_none() {
                *g = Some(reason.clone());
                true
            } else {
                false
            }
        });
        tracing::debug!(lease = %format_args!("{:x}", self.id), "etcd session gone");
        // After the mark: a grant on this session checks the mark after it records its hold.
        if let Some(holds) = self.holds.upgrade() {
            holds.session_gone(self, &reason);
        }
        KeepAlive::Gone(reason)
    }

    /// Why the session is gone, if it is.
    pub(crate) fn gone_reason(&self) -> Option<String> {
        self.gone.borrow().clone()
    }

    /// Resolves with the reason once the session is confirmed gone.
    pub(crate) fn gone(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        let mut rx = self.gone.subscribe();
        async move {
            let reason = match rx.wait_for(Option::is_some).await {
                Ok(reason) => reason.clone(),
                Err(_) => None,
            };
            match reason {
                Some(reason) => reason,
                // The session was dropped with its backend: nothing will report on it any more.
                None => std::future::pending().await,
            }
        }
    }

    /// Revokes the lease (best effort), ending every key on it.
    pub(crate) async fn revoke(&self) {
        let client = self.client();
        if let Err(e) = tokio::time::timeout(self.timeout, client.lease_revoke(self.id)).await {
            tracing::debug!(error = %e, "etcd lease revoke timed out");
        }
    }
}
