//! Acquire: the acquire script of the request's kind (with `WAIT` on the durable connection), and
//! waiting for a release on the kind's channel.

use std::fmt;
use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Grant};
use distlock_core::{LockKind, Result};
use redis::Value;

use crate::backend::RedisLease;
use crate::conn::{Ask, Link, Sent};
use crate::error::RedisError;
use crate::kinds::RW_RECHECK;
use crate::layout;
use crate::pubsub::Subscription;
use crate::rpc::{int, millis, pttl, request_error, server_error, ScriptCall};
use crate::RedisBackend;

/// How long a waiter sleeps when the holder's key has no expiry (not made by distlock or Redisson, or a
/// Redisson permit taken without a lease), so no pttl bounds the wait: it still wakes on every release
/// message.
const NO_EXPIRY_RECHECK: Duration = Duration::from_secs(5);

/// An acquire under way: the channel subscription, once the first wait made it.
pub struct RedisAcquisition {
    pub(crate) subscription: Option<Subscription>,
    /// Whether a grant may exist that the core has not seen (a try was sent and no busy reply came
    /// back), so `abandon` knows whether to undo.
    pub(crate) maybe_granted: bool,
    /// Where the last try went: the undo goes on the same connection, so that it runs after the try
    /// even when the try is still on its way (see [`undo`](crate::undo)).
    pub(crate) sent: Sent,
    /// Whether a try answered busy (a plain mutex without tokens then skips its bare `SET`; a fair
    /// waiter is in the queue from then on, and `abandon` takes it off).
    pub(crate) seen_busy: bool,
    /// The place in the fair queue the last busy try answered (0 = the head; −1 = none yet).
    pub(crate) position: i64,
}

impl RedisAcquisition {
    pub(crate) fn new() -> Self {
        Self {
            subscription: None,
            maybe_granted: false,
            sent: Sent::default(),
            seen_busy: false,
            position: -1,
        }
    }
}

impl fmt::Debug for RedisAcquisition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisAcquisition")
            .field("subscription", &self.subscription)
            .field("maybe_granted", &self.maybe_granted)
            .finish_non_exhaustive()
    }
}

/// The acquire script's reply (and the handoff and downgrade scripts', which have its shape).
pub(crate) enum Outcome {
    Granted {
        token: u64,
        pttl: Option<Duration>,
    },
    Busy {
        pttl: Option<Duration>,
        /// A fair try's place in the queue (0 = the head); 0 from other scripts.
        position: i64,
    },
    /// The name is in use as another kind (`layout::IN_USE_*`): nothing was written.
    Conflict {
        in_use: i64,
    },
    /// The semaphore's stored limit is another: nothing was taken.
    LimitMismatch {
        stored: u32,
    },
}

pub(crate) fn parse_acquire(v: &Value) -> std::result::Result<Outcome, RedisError> {
    let bad = || RedisError::Reply {
        what: "the acquire script",
        detail: format!("{v:?}"),
    };
    let Value::Array(items) = v else {
        return Err(bad());
    };
    let [granted, token, ttl] = items.as_slice() else {
        return Err(bad());
    };
    let (granted, token, ttl) = (
        int(granted).ok_or_else(bad)?,
        int(token).ok_or_else(bad)?,
        int(ttl).ok_or_else(bad)?,
    );
    match granted {
        1 => Ok(Outcome::Granted {
            token: u64::try_from(token).map_err(|_| bad())?,
            pttl: pttl(ttl),
        }),
        0 => Ok(Outcome::Busy {
            pttl: pttl(ttl),
            position: token,
        }),
        layout::KIND_CONFLICT => Ok(Outcome::Conflict { in_use: token }),
        layout::LIMIT_MISMATCH => Ok(Outcome::LimitMismatch {
            stored: u32::try_from(token).map_err(|_| bad())?,
        }),
        _ => Err(bad()),
    }
}

impl RedisBackend {
    /// `Backend::try_acquire`: waits for a pending undo of this owner (see [`crate::undo`]), then runs
    /// the acquire script once.
    pub(crate) async fn try_acquire_once(
        &self,
        acquisition: &mut RedisAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<RedisLease>> {
        if let Some(sub) = acquisition.subscription.as_mut() {
            // Messages from now on count: one arriving during this try makes the next wait return.
            sub.mark_seen();
        }
        self.after_pending_undo(request)
            .await
            .map_err(|e| e.into_core(Some(&request.name)))?;
        acquisition.maybe_granted = true;
        acquisition.sent = Sent::default();
        // A plain mutex without tokens: `SET NX PX` while the lock may be free; once busy, a waiter's
        // tries are the script alone (one request, which grants too when the key has gone).
        // A fair try joins the queue when busy, also a `try_acquire` that will not wait: its abandon
        // takes the place off again (one request more for a try that finds the lock held), so that a
        // waiter is queued from its first try on and need not try again once subscribed.
        let bare_set = request.kind == LockKind::Mutex
            && !self.mints_token()
            && self.inner.durable.is_none()
            && !self.is_fair(request.kind)
            && !acquisition.seen_busy;
        let outcome = self
            .acquire_once(request, bare_set, &mut acquisition.sent)
            .await
            .map_err(|e| e.into_core(Some(&request.name)))?;
        match outcome {
            Outcome::Granted { token, pttl } => {
                let grant = Grant::new(RedisLease {
                    lease: request.lease,
                    kind: request.kind,
                })
                .with_ttl(pttl.unwrap_or(request.lease).min(request.lease));
                let grant = self.with_minted(grant, token);
                Ok(Attempt::Acquired(match request.kind {
                    LockKind::Permit { .. } => {
                        grant.with_permit(layout::permit_hex(&layout::permit_id(&request.owner)))
                    }
                    _ => grant,
                }))
            }
            Outcome::Busy { pttl, position } => {
                acquisition.seen_busy = true;
                acquisition.position = position;
                acquisition.maybe_granted = false;
                acquisition.sent = Sent::default();
                Ok(Attempt::Busy { retry_after: pttl })
            }
            refused => {
                // Nothing was written: nothing to undo.
                acquisition.maybe_granted = false;
                acquisition.sent = Sent::default();
                Err(crate::kinds::refusal(request, &refused)
                    .unwrap_or_else(|| RedisError::Reply {
                        what: "the acquire script",
                        detail: "an answer of no known shape".into(),
                    })
                    .into_core(Some(&request.name)))
            }
        }
    }

    /// `sent` records the connection the try went on (for `abandon`), also if this future is dropped.
    /// `bare_set`: a plain mutex without tokens tries with `SET NX PX` first (see `set_if_absent`).
    async fn acquire_once(
        &self,
        request: &AcquireRequest,
        bare_set: bool,
        sent: &mut Sent,
    ) -> std::result::Result<Outcome, RedisError> {
        if bare_set {
            return self.set_if_absent(request, sent).await;
        }
        let call = self.acquire_call(request);
        self.grant_script(call, request, "acquire", sent).await
    }

    /// A plain layout's mutex without tokens: `SET NAME owner NX PX lease`, redis-py's and rslock's
    /// acquire, one command. Only when it answers "exists" does the plain acquire script run (without
    /// minting), to tell who holds the key: another value (busy, with its pttl), this owner's own (a
    /// resend after a lost reply: refreshed, granted), another kind's key, or a key gone since.
    async fn set_if_absent(
        &self,
        request: &AcquireRequest,
        sent: &mut Sent,
    ) -> std::result::Result<Outcome, RedisError> {
        let mut set = redis::cmd("SET");
        set.arg(layout::lock_key(&request.name))
            .arg(&request.owner)
            .arg("NX")
            .arg("PX")
            .arg(millis(request.lease));
        let set = &set;
        let reply = self
            .inner
            .link
            .run(
                &self.inner.target,
                "acquire",
                self.request_timeout(),
                Ask::Follow,
                |mut c| async move { set.query_async::<Value>(&mut c).await },
                sent,
            )
            .await?;
        if reply != Value::Nil {
            return Ok(Outcome::Granted {
                token: 0,
                pttl: Some(request.lease),
            });
        }
        let call = self.acquire_call(request);
        self.grant_script(call, request, "acquire", sent).await
    }

    /// Runs a script that may grant `request` (an acquire, a downgrade) and reads its answer: on the
    /// shared connection, or with `WAIT` on the durable one (see [`acquire_durable`](Self::acquire_durable)).
    pub(crate) async fn grant_script(
        &self,
        call: ScriptCall<'_>,
        request: &AcquireRequest,
        what: &'static str,
        sent: &mut Sent,
    ) -> std::result::Result<Outcome, RedisError> {
        let Some((gate, link)) = &self.inner.durable else {
            let value = self.script(&self.inner.link, what, call, sent).await?;
            return parse_acquire(&value);
        };
        // Boxed: the `WAIT` path's state would otherwise make every acquire's future (moved into
        // `async_trait`'s box on every try) several times larger.
        Box::pin(self.acquire_durable(call, request, gate, link, sent)).await
    }

    /// The script and `WAIT` in one pipeline on the durable connection; an undo when fewer replicas
    /// than required confirmed the grant.
    async fn acquire_durable(
        &self,
        call: ScriptCall<'_>,
        request: &AcquireRequest,
        gate: &tokio::sync::Mutex<()>,
        link: &Link,
        sent: &mut Sent,
    ) -> std::result::Result<Outcome, RedisError> {
        let name = &request.name;
        let _one_at_a_time = gate.lock().await;
        let mut pipe = redis::pipe();
        pipe.add_command(call.into_cmd())
            .add_command(self.wait_cmd());
        let timeout = self.request_timeout() + self.config().wait_timeout;
        let values = self
            // One lock's keys, and a `WAIT` that goes with them (to the target, after an `ASK`).
            .pipeline(link, "acquire + WAIT", timeout, Ask::Follow, pipe, sent)
            .await?;
        let [reply, waited] = values.as_slice() else {
            return Err(RedisError::Reply {
                what: "acquire + WAIT",
                detail: format!("{values:?}"),
            });
        };
        if let Some(e) = server_error(reply) {
            return Err(request_error("acquire", &self.inner.target, e));
        }
        let outcome = parse_acquire(reply)?;
        if let Outcome::Granted { .. } = outcome {
            let required = self.config().wait_replicas;
            let confirmed = match waited {
                Value::Int(n) => u32::try_from(*n).unwrap_or(0),
                other => {
                    if let Some(e) = server_error(other) {
                        tracing::warn!(error = %e, "WAIT failed");
                    }
                    0
                }
            };
            if confirmed < required {
                // Undo on the same connection, so the delete is ordered after the grant.
                match &sent.conn {
                    Some(conn) => {
                        self.undo_on(
                            conn.clone(),
                            name,
                            &request.owner,
                            request.kind,
                            self.undo_bound(),
                        )
                        .await?;
                    }
                    None => {
                        self.release_on(
                            link,
                            name,
                            &request.owner,
                            request.kind,
                            &mut Sent::default(),
                        )
                        .await?;
                    }
                }
                return Err(RedisError::Replicas {
                    confirmed,
                    required,
                });
            }
        }
        Ok(outcome)
    }

    /// `Backend::wait`: the first wait subscribes to the kind's channel and returns once the server
    /// confirmed it (the core tries again, and no release after that is missed); later waits sleep until
    /// a message on the channel or `retry_after` (the holder's pttl, a semaphore's earliest expiry),
    /// whichever is first; a read-write lock's waiter also after 0.5–1 s ([`RW_RECHECK`]), a plain
    /// layout's mutex waiter after ½–1× its `poll`.
    pub(crate) async fn wait_for_release(
        &self,
        acquisition: &mut RedisAcquisition,
        request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) {
        if acquisition.subscription.is_none() {
            let channel = self.wake_channel(&request.name, &request.owner, request.kind);
            let sub = if self.is_fair(request.kind) {
                // A fair waiter's own channel: nobody else listens there.
                self.inner.hub.register_lingering(channel)
            } else {
                self.inner.hub.register(channel)
            };
            let confirmed = sub.confirm().await;
            acquisition.subscription = Some(sub);
            match confirmed {
                // A fair waiter two places or more behind the head waits on without another try: a
                // release publishes to the head, so it could have missed its turn only if two waiters
                // before it were each granted and released (or left) within its subscribe, a fresh
                // process's pub/sub connect included (then its next try, at most a heartbeat later,
                // takes it). The head and the waiter right behind it try again, as every other
                // waiter does: the head may be about to take a free lock and release it at once.
                Ok(()) if self.is_fair(request.kind) && acquisition.position >= 2 => {
                    // The hub's connect wakes every waiter (for a reconnect's missed messages); for
                    // this waiter, subscribed just now, only what comes after counts.
                    if let Some(sub) = acquisition.subscription.as_mut() {
                        sub.mark_seen();
                    }
                }
                Ok(()) => return,
                Err(e) => {
                    // The hub wakes this waiter once it is connected again; until then the pttl bounds
                    // the wait.
                    tracing::debug!(error = %e, lock = %request.name, "cannot subscribe yet");
                }
            }
        }
        let Some(sub) = acquisition.subscription.as_mut() else {
            return;
        };
        let mut limit = retry_after.unwrap_or(NO_EXPIRY_RECHECK);
        if matches!(request.kind, LockKind::Read | LockKind::Write) {
            limit = limit.min(distlock_core::retry::jitter(RW_RECHECK));
        }
        if self.is_fair(request.kind) {
            // Each try keeps this waiter's place in the queue; a release by a client that is not
            // fair publishes nothing on this waiter's own channel.
            limit = limit.min(distlock_core::retry::jitter(layout::FAIR_HEARTBEAT));
        }
        if let (LockKind::Mutex, Some(poll)) = (request.kind, self.plain_poll()) {
            // A plain lock's holder may be a client that publishes nothing (redis-py).
            limit = limit.min(distlock_core::retry::jitter(poll));
        }
        tokio::select! {
            _ = sub.changed() => {}
            _ = tokio::time::sleep(limit) => {}
        }
    }
}
