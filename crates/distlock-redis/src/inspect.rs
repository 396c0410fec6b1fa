//! Inspect: the holder, its remaining lease, the last token and (outside Cluster) the waiters.

use distlock_core::raw::{HolderInfo, LockInfo};
use distlock_core::{FencingToken, Result};
use redis::Value;

use crate::conn::Sent;
use crate::layout;
use crate::rpc::{int, pttl, request_error, server_error};
use crate::RedisBackend;

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        _ => None,
    }
}

impl RedisBackend {
    /// `Backend::inspect`: `HGETALL`, `PTTL`, `GET` of the token key and `PUBSUB NUMSUB` in one
    /// pipeline.
    pub(crate) async fn inspect_lock(&self, name: &str) -> Result<LockInfo> {
        let cluster = self.inner.target.is_cluster();
        let mut pipe = redis::pipe();
        pipe.cmd("HGETALL")
            .arg(layout::lock_key(name))
            .cmd("PTTL")
            .arg(layout::lock_key(name))
            .cmd("GET")
            .arg(layout::token_key(name));
        if !cluster {
            pipe.cmd("PUBSUB").arg("NUMSUB").arg(layout::channel(name));
        }
        let values = self
            .pipeline(
                &self.inner.link,
                "inspect",
                self.request_timeout(),
                pipe,
                &mut Sent::default(),
            )
            .await
            .map_err(|e| e.into_core(Some(name)))?;
        for v in &values {
            if let Some(e) = server_error(v) {
                return Err(request_error("inspect", &self.inner.target, e).into_core(Some(name)));
            }
        }
        let mut info = LockInfo::default();
        let owner = match values.first() {
            Some(Value::Array(items)) => items.first().and_then(text),
            Some(Value::Map(pairs)) => pairs.first().and_then(|(k, _)| text(k)),
            _ => None,
        };
        if let Some(owner) = owner {
            info.holder = Some({
                let mut h = HolderInfo::default();
                h.owner = Some(owner);
                h.remaining_lease = values.get(1).and_then(int).and_then(pttl);
                h
            });
        }
        info.last_token = values
            .get(2)
            .and_then(int)
            .and_then(|t| u64::try_from(t).ok())
            .map(FencingToken::new);
        if !cluster {
            info.waiters = match values.get(3) {
                Some(Value::Array(items)) => items
                    .get(1)
                    .and_then(int)
                    .and_then(|n| usize::try_from(n).ok()),
                Some(Value::Map(pairs)) => pairs
                    .first()
                    .and_then(|(_, n)| int(n))
                    .and_then(|n| usize::try_from(n).ok()),
                _ => None,
            };
        }
        Ok(info)
    }
}
