//! Release: the owner-guarded compare-and-delete that publishes the unlock message (the script of the
//! hold's kind: see [`crate::kinds`]), and the undo of an acquire on the connection the acquire went on.

use std::time::Duration;

use distlock_core::raw::Released;
use distlock_core::{LockKind, Result};
use redis::Value;

use crate::backend::RedisLease;
use crate::conn::{Conn, Link, Sent};
use crate::error::RedisError;
use crate::rpc::int;
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
            .release_on(self.release_link(), name, owner, lease.kind, &mut sent)
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

    /// Compare-and-delete by owner on the link's connection, recording where it went in `sent`:
    /// whether this owner's lock was deleted. When the connection broke under a first attempt (its
    /// reply lost) and the retry finds nothing of this owner's, the first attempt may have been the one
    /// that deleted it: that is [`RedisError::ReleaseOutcomeUnknown`], never a plain "not held".
    pub(crate) async fn release_on(
        &self,
        link: &Link,
        name: &str,
        owner: &str,
        kind: LockKind,
        sent: &mut Sent,
    ) -> std::result::Result<bool, RedisError> {
        let call = self.release_call(name, owner, kind);
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
        kind: LockKind,
        bound: Duration,
    ) -> std::result::Result<(), RedisError> {
        let call = self.release_call(name, owner, kind);
        let target = &self.inner.target;
        match tokio::time::timeout(bound, call.query_on(&mut conn)).await {
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
