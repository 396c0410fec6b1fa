//! Lock kinds (issue 25): the read-write lock and the semaphore, on the mutex's connections, waits,
//! undos, renewal batches and pending-release registry. What differs per kind is only which script
//! runs with which keys (all of it in [`layout`]): this module builds those calls, and the downgrade.
//!
//! * **Read-write lock**: Redisson's `RReadWriteLock` hash at `NAME` (`mode`, a reader's field
//!   `<owner>` with its timeout key `{NAME}:<owner>:rwlock_timeout:1`, the writer's field
//!   `<owner>:write`), channel `redisson_rwlock:{NAME}`. A write grant `INCR`s the mutex's token key; a
//!   reader gets its current value. Readers first, as Redisson: a reader gets in whenever `mode` is
//!   `read`, writers waiting or not.
//! * **Semaphore**: Redisson's `RPermitExpirableSemaphore`: the counter `NAME`, the permits
//!   `{NAME}:timeout` (raw 16-byte ids, scores = expiry by the server's `TIME`), channel
//!   `redisson_sc:{NAME}`; every grant `INCR`s the token key. The limit is the counter plus the permits
//!   held, kept as long as the counter is.
//! * **One kind per name**: a mutex's hash, a read-write lock's hash (with `mode`) and a semaphore's
//!   counter refuse each other's acquires with `KindConflict` (the scripts look before they write).
//! * **Cluster slot migrations**: each script declares only real keys (channels and key prefixes are
//!   arguments), and checks the timeout keys it cannot declare before its first write
//!   ([`layout::ELSEWHERE`]): during a migration a script runs on the node that has all its keys, or
//!   answers `TRYAGAIN` until they are on one node, never on half of them.

use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Grant, Renewal};
use distlock_core::{Error, ErrorKind, LockKind, Result};

use crate::acquire::{Outcome, RedisAcquisition};
use crate::backend::RedisLease;
use crate::conn::Sent;
use crate::error::RedisError;
use crate::layout::{self, PrefixedKey};
use crate::rpc::{millis, ScriptCall};
use crate::{RedisBackend, RedisLayout};

/// How long a read-write lock's waiter sleeps at most between tries (jittered to 0.5–1 s): Redisson's
/// writer turning into a reader (its write release with read holds of its own) publishes nothing, and
/// a message may be missed while the pub/sub connection is remade, so the holder's pttl alone could
/// keep a waiter asleep for a whole lease after the lock let readers in.
pub(crate) const RW_RECHECK: Duration = Duration::from_secs(1);

impl RedisBackend {
    /// Whether the mutex uses the plain layout ([`RedisLayout::Plain`]): the kinds keep Redisson's.
    pub(crate) fn is_plain(&self) -> bool {
        matches!(self.config().layout, RedisLayout::Plain { .. })
    }

    /// How long a plain layout's mutex waiter sleeps at most between tries; `None` for Redisson's.
    pub(crate) fn plain_poll(&self) -> Option<Duration> {
        match self.config().layout {
            RedisLayout::Plain { poll, .. } => Some(poll),
            _ => None,
        }
    }

    /// Whether grants carry tokens: not with the plain layout's `tokens=false`, for any kind (the
    /// mutex's scripts then mint none; the read-write lock's and semaphore's still `INCR` the counter
    /// as Redisson's layout does, and their grants drop it, so that `Capabilities::fencing` is one
    /// answer for every kind).
    pub(crate) fn mints_token(&self) -> bool {
        !matches!(
            self.config().layout,
            RedisLayout::Plain { tokens: false, .. }
        )
    }

    /// `grant` with the token its script answered, where grants carry tokens ([`Self::mints_token`]).
    pub(crate) fn with_minted<L>(&self, grant: Grant<L>, token: u64) -> Grant<L> {
        if self.mints_token() {
            grant.with_token(distlock_core::FencingToken::new(token))
        } else {
            grant
        }
    }

    /// The plain scripts' last argument: `1` to mint a token, `0` not to.
    pub(crate) fn mint_flag(&self) -> &'static str {
        if self.mints_token() {
            "1"
        } else {
            "0"
        }
    }

    /// Whether `kind`'s waiters queue on the server (`fair=true`: a mutex's, in either layout).
    pub(crate) fn is_fair(&self, kind: LockKind) -> bool {
        self.config().fair && kind == LockKind::Mutex
    }

    /// The channel a waiter of `kind` listens on: a fair waiter's own, else the kind's release channel.
    pub(crate) fn wake_channel(&self, name: &str, owner: &str, kind: LockKind) -> String {
        match kind {
            LockKind::Read | LockKind::Write => layout::rw_channel(name),
            LockKind::Permit { .. } => layout::semaphore_channel(name),
            _ if self.is_fair(kind) => layout::waiter_channel(name, owner),
            _ if self.is_plain() => layout::plain_channel(name),
            _ => layout::channel(name),
        }
    }

    /// The acquire script's call for `request`'s kind.
    pub(crate) fn acquire_call(&self, request: &AcquireRequest) -> ScriptCall<'_> {
        let scripts = &self.inner.scripts;
        let (name, owner) = (request.name.as_str(), request.owner.as_str());
        let token_key = PrefixedKey {
            prefix: layout::TOKEN_PREFIX,
            name,
        };
        let lease = millis(request.lease);
        match request.kind {
            LockKind::Read => {
                let timeout = layout::read_timeout_prefix(name, owner);
                let write = layout::write_field(owner);
                let bytes = name.len() + timeout.len() + token_key.len() + 20 + owner.len() * 2;
                let mut call = ScriptCall::new(&scripts.read_acquire, 2, 6, bytes);
                call.arg(layout::lock_key(name))
                    .arg(token_key)
                    .arg(lease)
                    .arg(owner)
                    .arg(write)
                    .arg(timeout);
                call
            }
            LockKind::Write => {
                let write = layout::write_field(owner);
                let bytes = name.len() + token_key.len() + 20 + write.len();
                let mut call = ScriptCall::new(&scripts.write_acquire, 2, 4, bytes);
                call.arg(layout::lock_key(name))
                    .arg(token_key)
                    .arg(lease)
                    .arg(write);
                call
            }
            LockKind::Permit { limit } => {
                let timeout = layout::semaphore_timeout_key(name);
                let channel = PrefixedKey {
                    prefix: layout::SEMAPHORE_CHANNEL_PREFIX,
                    name,
                };
                let bytes = name.len() + timeout.len() + channel.len() + token_key.len() + 60;
                let mut call = ScriptCall::new(&scripts.permit_acquire, 3, 8, bytes);
                call.arg(layout::lock_key(name))
                    .arg(timeout)
                    .arg(token_key)
                    .arg(limit)
                    .arg(lease)
                    .arg(&layout::permit_id(owner)[..])
                    .arg(self.inner.publish)
                    .arg(channel);
                call
            }
            _ if self.is_fair(request.kind) => self.fair_acquire_call(request),
            _ => {
                let bytes = name.len() + token_key.len() + 20 + owner.len();
                if !self.is_plain() {
                    let mut call = ScriptCall::new(&scripts.acquire, 2, 4, bytes);
                    call.arg(layout::lock_key(name))
                        .arg(token_key)
                        .arg(lease)
                        .arg(owner);
                    return call;
                }
                let mut call = ScriptCall::new(&scripts.plain_acquire, 2, 5, bytes + 1);
                call.arg(layout::lock_key(name))
                    .arg(token_key)
                    .arg(lease)
                    .arg(owner)
                    .arg(self.mint_flag());
                call
            }
        }
    }

    /// The fair acquire script's call for a mutex `request` (see [`layout::FAIR_ACQUIRE`]).
    fn fair_acquire_call(&self, request: &AcquireRequest) -> ScriptCall<'_> {
        let scripts = &self.inner.scripts;
        let (name, owner) = (request.name.as_str(), request.owner.as_str());
        let token_key = PrefixedKey {
            prefix: layout::TOKEN_PREFIX,
            name,
        };
        let (queue, deadlines) = (layout::queue_key(name), layout::queue_timeout_key(name));
        let script = if self.is_plain() {
            &scripts.fair_plain_acquire
        } else {
            &scripts.fair_acquire
        };
        let bytes = name.len() + token_key.len() + queue.len() + deadlines.len() + owner.len() + 30;
        let mut call = ScriptCall::new(script, 4, 8, bytes);
        call.arg(layout::lock_key(name))
            .arg(token_key)
            .arg(queue)
            .arg(deadlines)
            .arg(millis(request.lease))
            .arg(owner)
            .arg(self.mint_flag())
            .arg(millis(layout::FAIR_LIVENESS));
        call
    }

    /// The release script's call for a hold of `kind` (also the undo of an acquire of it): deletes
    /// only what `owner` holds of that kind, and answers 1 if it did, else 0.
    pub(crate) fn release_call(&self, name: &str, owner: &str, kind: LockKind) -> ScriptCall<'_> {
        let scripts = &self.inner.scripts;
        let publish = self.inner.publish;
        match kind {
            LockKind::Read => {
                let channel = PrefixedKey {
                    prefix: layout::RW_CHANNEL_PREFIX,
                    name,
                };
                let timeout = layout::read_timeout_prefix(name, owner);
                let base = layout::suffix_base(name);
                let bytes = name.len() + channel.len() + timeout.len() + base.len() + owner.len();
                let mut call = ScriptCall::new(&scripts.read_release, 1, 7, bytes + 10);
                call.arg(layout::lock_key(name))
                    .arg(owner)
                    .arg(publish)
                    .arg(layout::UNLOCK_MESSAGE)
                    .arg(channel)
                    .arg(timeout)
                    .arg(base);
                call
            }
            LockKind::Write => {
                let channel = PrefixedKey {
                    prefix: layout::RW_CHANNEL_PREFIX,
                    name,
                };
                let write = layout::write_field(owner);
                let bytes = name.len() + channel.len() + write.len() + 10;
                let mut call = ScriptCall::new(&scripts.write_release, 1, 5, bytes);
                call.arg(layout::lock_key(name))
                    .arg(write)
                    .arg(publish)
                    .arg(layout::READ_UNLOCK_MESSAGE)
                    .arg(channel);
                call
            }
            LockKind::Permit { .. } => {
                let timeout = layout::semaphore_timeout_key(name);
                let channel = PrefixedKey {
                    prefix: layout::SEMAPHORE_CHANNEL_PREFIX,
                    name,
                };
                let bytes = name.len() + timeout.len() + channel.len() + 30;
                let mut call = ScriptCall::new(&scripts.permit_release, 2, 5, bytes);
                call.arg(layout::lock_key(name))
                    .arg(timeout)
                    .arg(&layout::permit_id(owner)[..])
                    .arg(publish)
                    .arg(channel);
                call
            }
            _ => {
                let prefix = if self.is_plain() {
                    layout::PLAIN_CHANNEL_PREFIX
                } else {
                    layout::CHANNEL_PREFIX
                };
                let channel = PrefixedKey { prefix, name };
                let bytes = name.len() + channel.len() + owner.len() + 10;
                if self.is_fair(kind) {
                    return self.fair_release_call(name, owner, channel, bytes);
                }
                let script = if self.is_plain() {
                    &scripts.plain_release
                } else {
                    &scripts.release
                };
                let mut call = ScriptCall::new(script, 1, 5, bytes);
                call.arg(layout::lock_key(name))
                    .arg(owner)
                    .arg(publish)
                    .arg(layout::UNLOCK_MESSAGE)
                    .arg(channel);
                call
            }
        }
    }

    /// The fair release script's call (see [`layout::FAIR_RELEASE`]): the layout's release arguments,
    /// with the queue's keys and the waiters' channel prefix.
    fn fair_release_call<'a>(
        &'a self,
        name: &str,
        owner: &str,
        channel: PrefixedKey<'_>,
        bytes: usize,
    ) -> ScriptCall<'a> {
        let script = if self.is_plain() {
            &self.inner.scripts.fair_plain_release
        } else {
            &self.inner.scripts.fair_release
        };
        let (queue, deadlines) = (layout::queue_key(name), layout::queue_timeout_key(name));
        let waiters = layout::waiter_channel_prefix(name);
        let bytes = bytes + queue.len() + deadlines.len() + waiters.len();
        let mut call = ScriptCall::new(script, 3, 8, bytes);
        call.arg(layout::lock_key(name))
            .arg(queue)
            .arg(deadlines)
            .arg(owner)
            .arg(self.inner.publish)
            .arg(layout::UNLOCK_MESSAGE)
            .arg(channel)
            .arg(waiters);
        call
    }

    /// The renew script's call for one entry of a batch, by its hold's kind. Every kind answers 1
    /// (extended), 0 (not this owner's), −1 (no key), −2 (another type), and the read and permit scripts
    /// −3 (the hold's own expiry passed).
    pub(crate) fn renew_call(&self, entry: &Renewal<'_, RedisLease>) -> ScriptCall<'_> {
        let scripts = &self.inner.scripts;
        let (name, owner, ttl) = (entry.name, entry.owner, millis(entry.ttl));
        match entry.lease.kind {
            LockKind::Read => {
                let timeout = layout::read_timeout_prefix(name, owner);
                let bytes = name.len() + timeout.len() + 20 + owner.len();
                let mut call = ScriptCall::new(&scripts.read_renew, 1, 4, bytes);
                call.arg(layout::lock_key(name))
                    .arg(ttl)
                    .arg(owner)
                    .arg(timeout);
                call
            }
            LockKind::Permit { .. } => {
                let timeout = layout::semaphore_timeout_key(name);
                let mut call = ScriptCall::new(&scripts.permit_renew, 1, 3, timeout.len() + 40);
                call.arg(timeout)
                    .arg(ttl)
                    .arg(&layout::permit_id(owner)[..]);
                call
            }
            kind => {
                // The mutex's script (the plain layout's has the same arguments); the write side's
                // field is `<owner>:write`.
                let (script, field) = match kind {
                    LockKind::Write => (
                        &scripts.renew,
                        std::borrow::Cow::Owned(layout::write_field(owner)),
                    ),
                    _ if self.is_plain() => {
                        (&scripts.plain_renew, std::borrow::Cow::Borrowed(owner))
                    }
                    _ => (&scripts.renew, std::borrow::Cow::Borrowed(owner)),
                };
                let bytes = name.len() + 20 + field.len();
                let mut call = ScriptCall::new(script, 1, 3, bytes);
                call.arg(layout::lock_key(name))
                    .arg(ttl)
                    .arg(field.as_ref());
                call
            }
        }
    }

    /// `Backend::downgrade`: one script ([`layout::DOWNGRADE`]) turns this owner's write hold into its
    /// read hold (with `WAIT` on the durable connection where configured, as a grant). The read grant
    /// carries no token of its own: the core gives it the write grant's. On an error the read hold
    /// the script may have made is undone as an abandoned acquire's (on the connection it went on).
    pub(crate) async fn downgrade_held(&self, read: &AcquireRequest) -> Result<Grant<RedisLease>> {
        self.after_pending_undo(read)
            .await
            .map_err(|e| e.into_core(Some(&read.name)))?;
        let scripts = &self.inner.scripts;
        let (name, owner) = (read.name.as_str(), read.owner.as_str());
        let timeout = layout::read_timeout_prefix(name, owner);
        let channel = PrefixedKey {
            prefix: layout::RW_CHANNEL_PREFIX,
            name,
        };
        let write = layout::write_field(owner);
        let bytes = name.len() + timeout.len() + channel.len() + owner.len() + write.len() + 30;
        let mut call = ScriptCall::new(&scripts.downgrade, 1, 8, bytes);
        call.arg(layout::lock_key(name))
            .arg(millis(read.lease))
            .arg(owner)
            .arg(&write)
            .arg(self.inner.publish)
            .arg(layout::READ_UNLOCK_MESSAGE)
            .arg(channel)
            .arg(timeout);
        let mut sent = Sent::default();
        match self.grant_script(call, read, "downgrade", &mut sent).await {
            Ok(Outcome::Granted { pttl, .. }) => Ok(Grant::new(RedisLease {
                lease: read.lease,
                kind: LockKind::Read,
            })
            .with_ttl(pttl.unwrap_or(read.lease).min(read.lease))),
            Ok(_) => Err(Error::new(
                ErrorKind::NotHeld,
                "the write lock was no longer held on the server (expired or deleted), so it could not become a read lock",
            )
            .with_backend(crate::error::BACKEND)
            .with_lock(name)),
            Err(e) => {
                let acquisition = RedisAcquisition {
                    subscription: None,
                    maybe_granted: true,
                    sent,
                    seen_busy: false,
                    position: -1,
                };
                self.undo_abandoned(acquisition, read).await;
                Err(e.into_core(Some(name)))
            }
        }
    }
}

/// The error for an acquire script's `KIND_CONFLICT` or `LIMIT_MISMATCH` answer.
pub(crate) fn refusal(request: &AcquireRequest, outcome: &Outcome) -> Option<RedisError> {
    match *outcome {
        Outcome::Conflict { in_use } => Some(RedisError::KindConflict {
            name: request.name.clone(),
            in_use,
            asked: request.kind,
        }),
        Outcome::LimitMismatch { stored } => Some(RedisError::LimitMismatch {
            name: request.name.clone(),
            stored,
            requested: match request.kind {
                LockKind::Permit { limit } => limit,
                _ => 0,
            },
        }),
        _ => None,
    }
}
