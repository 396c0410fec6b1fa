//! Handoff (issue 9): a hold ends with another owner of the same `Locks` first in the name's local
//! queue, and one script ([`layout::HAND_OFF`]) releases it and grants the lock to that owner, instead
//! of a release and that owner's acquire.
//!
//! Cancel safety and lost replies: from the moment the script may have reached the server until its
//! grant is returned, an [`UndoHandedGrant`] is armed. If the future is dropped, or the outcome is
//! unknown (no reply; a resend after a broken connection that found nothing), the next owner's
//! possible grant is undone as an abandoned acquire's is ([`crate::undo`]): on the connection the
//! script went on, the next owner marked pending until then, so that owner's own acquire waits for the
//! undo and cannot have its grant deleted by it. The old hold is the core's to release again
//! (owner-guarded); a handoff without a reply may still be on its way, so the old owner is settled as a
//! failed release is.

use distlock_core::raw::{AcquireRequest, Grant, HandOff, Released};
use distlock_core::{LockKind, Result};

use crate::acquire::{parse_acquire, Outcome, RedisAcquisition};
use crate::backend::RedisLease;
use crate::conn::Sent;
use crate::error::RedisError;
use crate::layout::{self, PrefixedKey};
use crate::rpc::{millis, ScriptCall};
use crate::RedisBackend;

/// Undoes the next owner's grant a handoff may have made, unless disarmed (the grant was returned, or
/// the script answered that it granted nothing).
struct UndoHandedGrant<'a> {
    backend: &'a RedisBackend,
    next: &'a AcquireRequest,
    /// Where the script went (kept alive: the undo goes on the same connection, ordered after it).
    sent: Sent,
    armed: bool,
}

impl Drop for UndoHandedGrant<'_> {
    fn drop(&mut self) {
        // Nothing left for the server (the script never went out), or nothing to undo.
        if !self.armed || self.sent.conn.is_none() {
            return;
        }
        // On distlock's background runtime, not the current one: a handoff is also dropped when its
        // runtime shuts down, and an undo spawned there would be dropped before it ran, leaving the
        // next owner's grant to block the name for its whole lease (review).
        let Some(runtime) = distlock_core::raw::background_runtime()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
        else {
            tracing::warn!(lock = %self.next.name, "a handoff was dropped with no runtime to undo it on; a grant it may have made expires with its lease");
            return;
        };
        let backend = self.backend.clone();
        let next = self.next.clone();
        // Pending from now on (not from when the task first runs): the next owner's acquire waits for
        // the undo.
        let hold = backend.inner.pending.hold(&next.name, &next.owner);
        let acquisition = RedisAcquisition {
            subscription: None,
            maybe_granted: true,
            sent: std::mem::take(&mut self.sent),
            seen_busy: false,
            position: -1,
        };
        tracing::debug!(lock = %next.name, "a handoff ended without its grant; undoing it");
        drop(runtime.spawn(async move {
            let _hold = hold;
            backend.undo_abandoned(acquisition, &next).await;
        }));
    }
}

impl RedisBackend {
    /// `Backend::hand_off`: see the [module](self).
    pub(crate) async fn hand_off_held(
        &self,
        lease: &RedisLease,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> Result<HandOff<RedisLease>> {
        // An undo or release of the next owner's still on its way would delete a grant made now; its
        // own acquire waits for that, so it acquires as usual. The script hands on a mutex only (the
        // core hands on between holds of one kind: a write lock's next writer acquires as usual).
        if lease.kind != LockKind::Mutex || self.inner.pending.is_pending(name, &next.owner) {
            return Ok(HandOff::Released(
                self.release_held(lease, name, owner).await?,
            ));
        }
        let mut undo = UndoHandedGrant {
            backend: self,
            next,
            sent: Sent::default(),
            armed: true,
        };
        let outcome = self.hand_off_once(name, owner, next, &mut undo.sent).await;
        match outcome {
            Ok(Outcome::Granted { token, pttl }) => {
                undo.armed = false;
                let grant = Grant::new(RedisLease {
                    lease: next.lease,
                    kind: LockKind::Mutex,
                })
                .with_ttl(pttl.unwrap_or(next.lease).min(next.lease));
                Ok(HandOff::Handed(self.with_minted(grant, token)))
            }
            Ok(Outcome::Busy { .. } | Outcome::Conflict { .. } | Outcome::LimitMismatch { .. })
                if !undo.sent.resent =>
            {
                undo.armed = false;
                Ok(HandOff::Released(Released::NotHeld))
            }
            // Sent again after a broken connection, and nothing of the old owner's found: the first
            // attempt may have handed the lock on (the undo takes back that grant), or the hold had
            // gone. As a release's resend, the outcome is unknown.
            Ok(_) => Err(RedisError::ReleaseOutcomeUnknown {
                target: self.inner.target.shown.clone(),
            }
            .into_core(Some(name))),
            // Refused by the server, which ran nothing (the script fails before its first write, e.g.
            // a token counter that is not an integer): released as usual instead.
            Err(e) if e.is_refusal() && !undo.sent.resent => {
                undo.armed = false;
                tracing::debug!(lock = %name, error = %e, "handoff refused; releasing instead");
                Ok(HandOff::Released(
                    self.release_held(lease, name, owner).await?,
                ))
            }
            Err(e) => {
                // The script may still be on its way: the old owner's next acquire waits for it, as
                // after a failed release.
                let sent = Sent {
                    conn: undo.sent.conn.clone(),
                    resent: undo.sent.resent,
                };
                let within = lease.lease.max(self.request_timeout());
                self.settle_in_background(&e, sent, name, owner, within);
                Err(e.into_core(Some(name)))
            }
        }
    }

    /// The handoff script once, on the connection every acquire and release goes on.
    async fn hand_off_once(
        &self,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
        sent: &mut Sent,
    ) -> std::result::Result<Outcome, RedisError> {
        let token_key = PrefixedKey {
            prefix: layout::TOKEN_PREFIX,
            name,
        };
        let bytes = name.len() + token_key.len() + owner.len() + 20 + next.owner.len();
        let scripts = &self.inner.scripts;
        let plain = self.is_plain();
        let script = if plain {
            &scripts.plain_hand_off
        } else {
            &scripts.hand_off
        };
        let mut call = ScriptCall::new(script, 2, 6, bytes + 1);
        call.arg(layout::lock_key(name))
            .arg(token_key)
            .arg(owner)
            .arg(millis(next.lease))
            .arg(&next.owner);
        if plain {
            call.arg(self.mint_flag());
        }
        let value = self.script(&self.inner.link, "handoff", call, sent).await?;
        parse_acquire(&value)
    }
}
