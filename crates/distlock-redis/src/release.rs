//! Release: the owner-guarded compare-and-delete that publishes the unlock message, and the undo of an
//! acquire on the connection the acquire went on.

use std::time::Duration;

use distlock_core::raw::Released;
use distlock_core::Result;
use redis::Value;

use crate::backend::RedisLease;
use crate::conn::{Conn, Link, Sent};
use crate::error::RedisError;
use crate::layout;
use crate::layout::PrefixedKey;
use crate::rpc::{int, ScriptCall};
use crate::RedisBackend;

fn parse_release(value: &Value) -> std::result::Result<bool, RedisError> {
    match int(value) {
        Some(1) => Ok(true),
        Some(0) => Ok(false),
        _ => Err(RedisError::Reply {
            what: "the release script",
            detail: format!("{value:?}"),
        }),
    }
}

impl RedisBackend {
    /// `Backend::release`. A release that failed without a reply may still be on its way: the same
    /// owner's next acquire waits for it (see [`crate::undo`]).
    pub(crate) async fn release_held(
        &self,
        lease: &RedisLease,
        name: &str,
        owner: &str,
    ) -> Result<Released> {
        let mut sent = Sent::default();
        let released = self
            .release_on(self.release_link(), name, owner, &mut sent)
            .await;
        if let Err(e) = &released {
            let within = lease.lease.max(self.request_timeout());
            self.settle_in_background(e, sent, name, owner, within);
        }
        let released = released.map_err(|e| e.into_core(Some(name)))?;
        Ok(if released {
            Released::Released
        } else {
            Released::NotHeld
        })
    }

    /// The release script's call for the undo on an acquire's connection (see [`undo_on`](Self::undo_on));
    /// [`release_on`](Self::release_on) builds the same call as a [`ScriptCall`].
    fn release_invocation<'a>(&'a self, name: &str, owner: &str) -> redis::ScriptInvocation<'a> {
        let mut invocation = self.inner.scripts.release.prepare_invoke();
        invocation
            .key(layout::lock_key(name))
            .key(layout::channel(name))
            .arg(owner)
            .arg(self.inner.publish)
            .arg(layout::UNLOCK_MESSAGE);
        invocation
    }

    /// Compare-and-delete by owner on the link's connection, recording where it went in `sent`:
    /// whether this owner's lock was deleted. When the connection broke under a first attempt (its
    /// reply lost) and the retry finds nothing of this owner's, the first attempt may have been the one
    /// that deleted it: that is [`RedisError::ReleaseOutcomeUnknown`], never a plain "not held".
    pub(crate) async fn release_on(
        &self,
        link: &Link,
        name: &str,
        owner: &str,
        sent: &mut Sent,
    ) -> std::result::Result<bool, RedisError> {
        let channel = PrefixedKey {
            prefix: layout::CHANNEL_PREFIX,
            name,
        };
        let bytes = name.len() + channel.len() + owner.len() + 10;
        let mut call = ScriptCall::new(&self.inner.scripts.release, 2, 5, bytes);
        // As `release_invocation`.
        call.arg(layout::lock_key(name))
            .arg(channel)
            .arg(owner)
            .arg(self.inner.publish)
            .arg(layout::UNLOCK_MESSAGE);
        let value = self.script(link, "release", call, sent).await?;
        match parse_release(&value)? {
            false if sent.resent => Err(RedisError::ReleaseOutcomeUnknown {
                target: self.inner.target.shown.clone(),
            }),
            released => Ok(released),
        }
    }

    /// The undo of an acquire, on the connection the acquire went on: Redis runs one connection's
    /// commands in order, so it runs after the acquire even if that is still on its way. The link may
    /// have dropped that connection after the acquire timed out; whatever reply comes back here, the
    /// undo itself is queued behind the acquire on the server's side of the connection.
    pub(crate) async fn undo_on(
        &self,
        mut conn: Conn,
        name: &str,
        owner: &str,
        bound: Duration,
    ) -> std::result::Result<(), RedisError> {
        let invocation = self.release_invocation(name, owner);
        let target = &self.inner.target;
        match tokio::time::timeout(bound, invocation.invoke_async::<Value>(&mut conn)).await {
            Ok(Ok(value)) => parse_release(&value).map(|undone| {
                if undone {
                    tracing::debug!(lock = %name, "undid an abandoned grant");
                }
            }),
            Ok(Err(source)) => Err(RedisError::Request {
                what: "undo of an acquire",
                target: target.shown.clone(),
                source,
            }),
            Err(_) => Err(RedisError::Timeout {
                what: "undo of an acquire",
                target: target.shown.clone(),
                after: bound,
            }),
        }
    }
}
