//! Break (`distlock break`, `Locks::break_holder`): an operator ends another holder's exclusive hold
//! in one script ([`layout::BREAK`]), only if the hold `inspect` showed still holds it.
//!
//! The hold is told by its owner id and, where `inspect` showed one, its hold id
//! (`HolderInfo::hold_id`): the name's token counter as the inspect script read it with the holder.
//! Every grant that mints a token `INCR`s that counter (in every layout and deployment: standalone,
//! Sentinel, Cluster, where the counter is in the name's slot), so the break script, which reads it
//! too, answers "not broken" once a grant came since: a `Lock` that released and acquired again (same
//! owner id) keeps its new hold. `inspect` shows a hold id only where this client's grants mint tokens
//! (not with `layout=plain&tokens=false`) and the counter exists.
//!
//! Holders that mint no token leave the counter alone, and are matched by their owner id only: a
//! Redisson `RLock` or `RReadWriteLock` (whose owner, `<client id>:<thread id>`, is shared by every hold
//! taken on one pooled thread), a plain lock with `tokens=false`, redis-py's. A later hold of such an
//! owner, taken between the operator's `inspect` and the break, is broken by it. So is any hold when
//! the holder given has no hold id (built by hand with an owner id alone).
//!
//! Readers and permits are not broken: a holder given that is itself a reader of the name, or whose
//! permit is held there, is `Unsupported`. A writer or mutex holder shown that has gone is `false`,
//! whatever holds the name now (readers, permits, another writer).

use distlock_core::raw::HolderInfo;
use distlock_core::{Error, ErrorKind, Result};

use crate::conn::Sent;
use crate::error::{RedisError, BACKEND};
use crate::layout::{self, PrefixedKey};
use crate::rpc::{int, ScriptCall};
use crate::RedisBackend;

/// Why break refuses a reader or a permit's holder.
const SHARED: &str = "break ends an exclusive holder only (a mutex or a write lock)";

impl RedisBackend {
    /// `Backend::break_holder`: see the [module](self).
    pub(crate) async fn break_exclusive(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        let Some(owner) = holder.owner.as_deref() else {
            if holder.permit.is_some() {
                return Err(RedisError::Unsupported(format!(
                    "{SHARED}: a permit of a semaphore cannot be broken"
                ))
                .into_core(Some(name)));
            }
            return Err(RedisError::Config(
                "the holder to break has no owner id: pass the holder inspect showed".into(),
            )
            .into_core(Some(name)));
        };
        let call = self.break_call(name, owner, holder.hold_id.as_deref());
        let mut sent = Sent::default();
        let value = self
            .script(&self.inner.link, "break", call, &mut sent)
            .await
            .map_err(|e| e.into_core(Some(name)))?;
        match int(&value) {
            Some(1) => Ok(true),
            // The first attempt's reply was lost with its connection: it may be the one that ended
            // the hold.
            Some(0) if sent.resent => Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "the break's outcome is unknown: it was sent again after the connection to {} broke before the reply came back, and the second attempt found the hold gone (the first may have ended it, or it had ended already); inspect the lock again",
                    self.inner.target.shown
                ),
            )
            .with_backend(BACKEND)
            .with_lock(name)),
            Some(0) => Ok(false),
            Some(layout::BREAK_READERS) => Err(RedisError::Unsupported(format!(
                "{SHARED}: {owner:?} holds a read lock of {name:?}, which is left holding"
            ))
            .into_core(Some(name))),
            Some(layout::BREAK_PERMITS) => Err(RedisError::Unsupported(format!(
                "{SHARED}: {owner:?} holds a permit of the semaphore {name:?}, which is left holding"
            ))
            .into_core(Some(name))),
            _ => Err(RedisError::Reply {
                what: "the break script",
                detail: format!("{value:?}"),
            }
            .into_core(Some(name))),
        }
    }

    /// The break script's call (see [`layout::BREAK`]): the token counter declared, and `hold_id`
    /// compared with it, only when a hold id is given.
    fn break_call(&self, name: &str, owner: &str, hold_id: Option<&str>) -> ScriptCall<'_> {
        let channel = |prefix| PrefixedKey { prefix, name };
        let (queue, deadlines) = (layout::queue_key(name), layout::queue_timeout_key(name));
        let permits = layout::semaphore_timeout_key(name);
        let write = layout::write_field(owner);
        let waiters = layout::waiter_channel_prefix(name);
        let permit = layout::permit_id(owner);
        let counter = channel(layout::TOKEN_PREFIX);
        let (release, plain, rw) = (
            channel(layout::CHANNEL_PREFIX),
            channel(layout::PLAIN_CHANNEL_PREFIX),
            channel(layout::RW_CHANNEL_PREFIX),
        );
        let bytes = name.len()
            + queue.len()
            + deadlines.len()
            + permits.len()
            + hold_id.map_or(0, |id| counter.len() + id.len())
            + owner.len()
            + write.len()
            + release.len()
            + plain.len()
            + rw.len()
            + waiters.len()
            + permit.len()
            + 20;
        let keys = if hold_id.is_some() { 5 } else { 4 };
        let mut call = ScriptCall::new(&self.inner.scripts.break_holder, keys, keys + 11, bytes);
        call.arg(layout::lock_key(name))
            .arg(queue)
            .arg(deadlines)
            .arg(permits);
        if hold_id.is_some() {
            call.arg(counter);
        }
        call.arg(owner)
            .arg(write)
            .arg(self.inner.publish)
            .arg(layout::UNLOCK_MESSAGE)
            .arg(layout::READ_UNLOCK_MESSAGE)
            .arg(release)
            .arg(plain)
            .arg(rw)
            .arg(waiters)
            .arg(&permit[..]);
        if let Some(hold_id) = hold_id {
            call.arg(hold_id);
        }
        call
    }
}
