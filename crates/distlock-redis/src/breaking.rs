//! Break (`distlock break`, `Locks::break_holder`): an operator ends another holder's exclusive hold
//! in one script ([`layout::BREAK`]), only if the owner `inspect` showed still holds it.
//!
//! The holder is matched by its owner id alone: none of Redis's layouts keeps a holder's fencing token
//! with its hold (`inspect` shows none), so a token in the [`HolderInfo`] is not compared. An owner id
//! is one `Lock`'s, so a later hold of that same `Lock` (the same process) is broken by a break aimed
//! at its earlier hold; a holder that came since from any other `Lock` never is.

use distlock_core::raw::HolderInfo;
use distlock_core::{Error, ErrorKind, Result};

use crate::conn::Sent;
use crate::error::{RedisError, BACKEND};
use crate::layout::{self, PrefixedKey};
use crate::rpc::{int, ScriptCall};
use crate::RedisBackend;

/// Why break refuses a name held by readers or permits.
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
        let call = self.break_call(name, owner);
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
                "{SHARED}: {name:?} is held by readers, which are left holding"
            ))
            .into_core(Some(name))),
            Some(layout::BREAK_PERMITS) => Err(RedisError::Unsupported(format!(
                "{SHARED}: {name:?} is a semaphore with permits held, which are left holding"
            ))
            .into_core(Some(name))),
            _ => Err(RedisError::Reply {
                what: "the break script",
                detail: format!("{value:?}"),
            }
            .into_core(Some(name))),
        }
    }

    /// The break script's call (see [`layout::BREAK`]).
    fn break_call(&self, name: &str, owner: &str) -> ScriptCall<'_> {
        let channel = |prefix| PrefixedKey { prefix, name };
        let (queue, deadlines) = (layout::queue_key(name), layout::queue_timeout_key(name));
        let permits = layout::semaphore_timeout_key(name);
        let write = layout::write_field(owner);
        let waiters = layout::waiter_channel_prefix(name);
        let (release, plain, rw) = (
            channel(layout::CHANNEL_PREFIX),
            channel(layout::PLAIN_CHANNEL_PREFIX),
            channel(layout::RW_CHANNEL_PREFIX),
        );
        let bytes = name.len()
            + queue.len()
            + deadlines.len()
            + permits.len()
            + owner.len()
            + write.len()
            + release.len()
            + plain.len()
            + rw.len()
            + waiters.len()
            + 20;
        let mut call = ScriptCall::new(&self.inner.scripts.break_holder, 4, 13, bytes);
        call.arg(layout::lock_key(name))
            .arg(queue)
            .arg(deadlines)
            .arg(permits)
            .arg(owner)
            .arg(write)
            .arg(self.inner.publish)
            .arg(layout::UNLOCK_MESSAGE)
            .arg(layout::READ_UNLOCK_MESSAGE)
            .arg(release)
            .arg(plain)
            .arg(rw)
            .arg(waiters);
        call
    }
}
