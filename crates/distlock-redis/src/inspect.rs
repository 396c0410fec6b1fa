//! Inspect: what holds the name (mutex, writer, readers or permits) with each holder's remaining
//! lease, the last token and (outside Cluster) the waiters.

use std::time::Duration;

use distlock_core::raw::{HolderInfo, LockInfo};
use distlock_core::{FencingToken, LockKind, Result};
use redis::Value;

use crate::conn::{Ask, Sent};
use crate::error::{ClusterRefusal, RedisError};
use crate::layout::{self, PrefixedKey};
use crate::rpc::{int, pttl, request_error, server_error, ScriptCall};
use crate::RedisBackend;

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// The subscriber count of each channel in a `PUBSUB NUMSUB` reply (RESP2 array or RESP3 map).
fn numsub(value: Option<&Value>) -> Vec<(String, usize)> {
    let count = |n: &Value| int(n).and_then(|n| usize::try_from(n).ok()).unwrap_or(0);
    match value {
        Some(Value::Array(items)) => items
            .chunks(2)
            .filter_map(|pair| match pair {
                [channel, n] => text(channel).map(|c| (c, count(n))),
                _ => None,
            })
            .collect(),
        Some(Value::Map(pairs)) => pairs
            .iter()
            .filter_map(|(channel, n)| text(channel).map(|c| (c, count(n))))
            .collect(),
        _ => Vec::new(),
    }
}

/// The (field, value) pairs of an `HGETALL` reply, or the (member, score) pairs of a `ZRANGE …
/// WITHSCORES` reply, as RESP2 (one flat array) or RESP3 (a map, or an array of pairs) gives them.
fn pairs(value: &Value) -> Vec<(Value, Value)> {
    match value {
        Value::Map(pairs) => pairs.clone(),
        Value::Array(items) if items.iter().all(|i| matches!(i, Value::Array(_))) => items
            .iter()
            .filter_map(|pair| match pair {
                Value::Array(pair) => match pair.as_slice() {
                    [a, b] => Some((a.clone(), b.clone())),
                    _ => None,
                },
                _ => None,
            })
            .collect(),
        Value::Array(items) => items
            .chunks(2)
            .filter_map(|pair| match pair {
                [a, b] => Some((a.clone(), b.clone())),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A sorted set's score (a string in RESP2, a double in RESP3).
fn score(value: &Value) -> Option<f64> {
    match value {
        Value::Double(d) => Some(*d),
        Value::Int(i) => Some(*i as f64),
        v => text(v)?.parse().ok(),
    }
}

/// `TIME`'s reply in milliseconds.
fn time_ms(value: &Value) -> Option<i64> {
    let Value::Array(parts) = value else {
        return None;
    };
    let [seconds, micros] = parts.as_slice() else {
        return None;
    };
    Some(int(seconds)? * 1000 + int(micros)? / 1000)
}

impl RedisBackend {
    /// `Backend::inspect`: the inspect script ([`layout::INSPECT`]) and, outside Cluster, `PUBSUB
    /// NUMSUB` of the three kinds' channels, in one pipeline. In a Cluster slot under migration the
    /// name's keys may be split between the two nodes (`MIGRATE` moves keys in batches), and Redis
    /// runs the script only where all of them are: then each key is read where it is
    /// ([`inspect_by_key`](Self::inspect_by_key)).
    pub(crate) async fn inspect_lock(&self, name: &str) -> Result<LockInfo> {
        let cluster = self.inner.target.is_cluster();
        let timeout = layout::semaphore_timeout_key(name);
        let base = layout::suffix_base(name);
        let token_key = PrefixedKey {
            prefix: layout::TOKEN_PREFIX,
            name,
        };
        let bytes = name.len() + token_key.len() + timeout.len() + base.len();
        let mut call = ScriptCall::new(&self.inner.scripts.inspect, 3, 4, bytes);
        call.arg(layout::lock_key(name))
            .arg(token_key)
            .arg(&timeout)
            .arg(&base);
        let channels = [
            // A mutex's waiters that are not fair (a fair one listens on its own channel, and is
            // counted in the queue below).
            if self.is_plain() {
                layout::plain_channel(name)
            } else {
                layout::channel(name)
            },
            layout::rw_channel(name),
            layout::semaphore_channel(name),
        ];
        let mut pipe = redis::pipe();
        pipe.add_command(call.into_cmd());
        if !cluster {
            // The fair queue whatever this client's own mode: `status` has no `fair`, and fair
            // waiters listen on channels of their own.
            pipe.cmd("PUBSUB").arg("NUMSUB").arg(&channels[..]);
            pipe.cmd("LLEN").arg(layout::queue_key(name));
        }
        let ask = if cluster { Ask::Return } else { Ask::Follow };
        let values = match self.inspect_pipeline(pipe, ask).await {
            Err(e)
                if matches!(
                    e.cluster_refusal(),
                    Some(ClusterRefusal::Ask(_) | ClusterRefusal::TryAgain)
                ) =>
            {
                tracing::debug!(lock = %name, "a slot under migration: inspecting each key where it is");
                self.inspect_by_key(name).await.map(|reply| vec![reply])
            }
            values => values,
        }
        .map_err(|e| e.into_core(Some(name)))?;
        for v in &values {
            if let Some(e) = server_error(v) {
                return Err(request_error("inspect", &self.inner.target, e).into_core(Some(name)));
            }
        }
        let mut info = parse_inspect(values.first()).map_err(|e| e.into_core(Some(name)))?;
        if !self.mints_token() {
            // The counter may be left from before `tokens=false`: nothing of this backend's. Nor is
            // it the hold's identity: these grants do not move it (see `breaking`).
            info.last_token = None;
            if let Some(holder) = info.holder.as_mut() {
                holder.hold_id = None;
            }
        }
        if !cluster {
            let counts = numsub(values.get(1));
            let of = |channel: &str| {
                counts
                    .iter()
                    .filter(|(c, _)| c == channel)
                    .map(|(_, n)| n)
                    .sum::<usize>()
            };
            let queued = match values.get(2) {
                Some(Value::Int(n)) => usize::try_from(*n).unwrap_or(0),
                _ => 0,
            };
            info.waiters = Some(match info.kind {
                Some(LockKind::Mutex) => of(&channels[0]) + queued,
                Some(LockKind::Read | LockKind::Write) => of(&channels[1]),
                Some(LockKind::Permit { .. }) => of(&channels[2]),
                _ => channels.iter().map(|c| of(c)).sum::<usize>() + queued,
            });
        }
        Ok(info)
    }

    /// The inspect script's reply ([`layout::INSPECT`]), made of requests about one key each, every
    /// one following its own `ASK`: for a Cluster slot under migration, whose keys may be on either
    /// node. The token key first, then the name's key (`TYPE`, `PTTL`), then what the type says:
    /// the hash (`HGETALL`) and each reader's timeout keys (`PTTL`), or the semaphore's counter (`GET`) and
    /// its permits (`ZRANGE`, with `TIME`). Not one snapshot, as the script's reply is: a key read after
    /// another may have changed in between (a status report, never a decision). The counter is read
    /// before the holder, so the hold id it gives a holder is never newer than that holder's grant: a
    /// grant between the two reads makes a break answer "not broken", never break a later hold.
    async fn inspect_by_key(&self, name: &str) -> std::result::Result<Value, RedisError> {
        let lock = layout::lock_key(name);
        let bad = |detail: String| RedisError::Reply {
            what: "inspect",
            detail,
        };
        // The token counter first, then the holder (see above).
        let mut token = redis::pipe();
        token.cmd("GET").arg(layout::token_key(name));
        let token = self.inspect_one(token, 1).await?;
        let mut head = redis::pipe();
        head.cmd("TYPE").arg(lock).cmd("PTTL").arg(lock);
        let head = self.inspect_one(head, 2).await?;
        let [kind, lock_pttl] = head.as_slice() else {
            return Err(bad(format!("{head:?}")));
        };
        let token = match token.first() {
            Some(Value::Nil) | None => Value::BulkString(Vec::new()),
            Some(token) => token.clone(),
        };
        let mut out = vec![kind.clone(), token, Value::Int(0)];
        match text(kind).as_deref() {
            Some("hash") => {
                let mut hash = redis::pipe();
                hash.cmd("HGETALL").arg(lock);
                let fields = pairs(&self.inspect_one(hash, 1).await?[0]);
                let field_text = |f: &Value| text(f).unwrap_or_default();
                let mode = fields
                    .iter()
                    .find(|(f, _)| field_text(f) == "mode")
                    .and_then(|(_, v)| text(v));
                out[0] = Value::BulkString(mode.as_deref().unwrap_or("mutex").into());
                let holders = fields.iter().filter(|(f, _)| field_text(f) != "mode");
                match mode.as_deref() {
                    None => {
                        for (field, _) in holders {
                            out.extend([field.clone(), lock_pttl.clone()]);
                        }
                    }
                    Some("write") => {
                        for (field, _) in holders {
                            if let Some(owner) =
                                field_text(field).strip_suffix(layout::WRITE_SUFFIX)
                            {
                                out.extend([Value::BulkString(owner.into()), lock_pttl.clone()]);
                            }
                        }
                    }
                    Some("read") => {
                        let base = layout::suffix_base(name);
                        let readers: Vec<(Value, u64)> = holders
                            .filter(|(f, _)| !field_text(f).ends_with(layout::WRITE_SUFFIX))
                            .map(|(f, count)| {
                                let count = int(count).and_then(|c| u64::try_from(c).ok());
                                (f.clone(), count.unwrap_or(0))
                            })
                            .collect();
                        let remains = futures_util::future::try_join_all(readers.iter().map(
                            |(field, count)| {
                                let keys: Vec<String> = (1..=*count)
                                    .map(|i| {
                                        format!(
                                            "{base}:{}{}:{i}",
                                            field_text(field),
                                            layout::RW_TIMEOUT_SUFFIX
                                        )
                                    })
                                    .collect();
                                self.longest_pttl(keys)
                            },
                        ))
                        .await?;
                        for ((field, _), remain) in readers.into_iter().zip(remains) {
                            out.extend([field, Value::Int(remain)]);
                        }
                    }
                    // Another mode: no holder, as the script says.
                    Some(_) => {}
                }
            }
            Some("string") => {
                let mut counter = redis::pipe();
                counter.cmd("GET").arg(lock);
                let value = self.inspect_one(counter, 1).await?.swap_remove(0);
                if value == Value::Nil {
                    // Expired or deleted since `TYPE`: nothing held.
                    out[0] = Value::BulkString(b"none".to_vec());
                    return Ok(Value::Array(out));
                }
                // The script's rule: digits only, with no expiry or with permits beside it, is a
                // semaphore's counter; any other string a plain layout's lock, its value the holder.
                let digits = text(&value)
                    .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|v| v.parse::<i64>().ok());
                let plain_lock = |mut out: Vec<Value>| {
                    out[0] = Value::BulkString(b"mutex".to_vec());
                    out.extend([value.clone(), lock_pttl.clone()]);
                    Ok(Value::Array(out))
                };
                let Some(available) = digits else {
                    return plain_lock(out);
                };
                let mut permits = redis::pipe();
                permits
                    .cmd("ZRANGE")
                    .arg(layout::semaphore_timeout_key(name))
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .cmd("TIME");
                let replies = self.inspect_one(permits, 2).await?;
                let now = time_ms(&replies[1]).ok_or_else(|| bad(format!("{replies:?}")))?;
                let held = pairs(&replies[0]);
                if int(lock_pttl) != Some(-1) && held.is_empty() {
                    return plain_lock(out);
                }
                out[0] = Value::BulkString(b"permit".to_vec());
                out[2] = Value::Int(available + i64::try_from(held.len()).unwrap_or(i64::MAX));
                for (member, expiry) in held {
                    let expiry = score(&expiry).ok_or_else(|| bad(format!("{expiry:?}")))?;
                    let ms = if expiry >= layout::NON_EXPIRABLE as f64 {
                        -1
                    } else {
                        expiry as i64 - now
                    };
                    out.extend([member, Value::Int(ms)]);
                }
            }
            _ => {}
        }
        Ok(Value::Array(out))
    }

    /// The longest `PTTL` of `keys` (−2 when there is none), each read where it is.
    async fn longest_pttl(&self, keys: Vec<String>) -> std::result::Result<i64, RedisError> {
        let pttls = futures_util::future::try_join_all(keys.into_iter().map(|key| async move {
            let mut pipe = redis::pipe();
            pipe.cmd("PTTL").arg(key);
            self.inspect_one(pipe, 1).await
        }))
        .await?;
        Ok(pttls
            .iter()
            .filter_map(|reply| int(&reply[0]))
            .fold(-2, i64::max))
    }

    /// A pipeline about one key (following its `ASK`), whose `count` replies must all be values.
    async fn inspect_one(
        &self,
        pipe: redis::Pipeline,
        count: usize,
    ) -> std::result::Result<Vec<Value>, RedisError> {
        let values = self.inspect_pipeline(pipe, Ask::Follow).await?;
        if let Some(e) = values.iter().find_map(server_error) {
            return Err(request_error("inspect", &self.inner.target, e));
        }
        if values.len() != count {
            return Err(RedisError::Reply {
                what: "inspect",
                detail: format!("{} replies for {count} commands", values.len()),
            });
        }
        Ok(values)
    }

    async fn inspect_pipeline(
        &self,
        pipe: redis::Pipeline,
        ask: Ask,
    ) -> std::result::Result<Vec<Value>, RedisError> {
        self.pipeline(
            &self.inner.link,
            "inspect",
            self.request_timeout(),
            ask,
            pipe,
            &mut Sent::default(),
        )
        .await
    }
}

/// The inspect script's reply: `{kind, token, limit, holder, ms, …}`. A mutex's or writer's holder
/// gets the token counter's value (when it exists) as its `hold_id`.
fn parse_inspect(value: Option<&Value>) -> std::result::Result<LockInfo, RedisError> {
    let bad = || RedisError::Reply {
        what: "the inspect script",
        detail: format!("{value:?}"),
    };
    let Some(Value::Array(items)) = value else {
        return Err(bad());
    };
    let [kind, token, limit, holders @ ..] = items.as_slice() else {
        return Err(bad());
    };
    let mut info = LockInfo::default();
    let counter = text(token).filter(|t| !t.is_empty());
    info.last_token = counter
        .as_deref()
        .and_then(|t| t.parse::<u64>().ok())
        .map(FencingToken::new);
    // A negative remainder is an expired hold not cleaned up yet (a crashed reader's field, a permit
    // nobody reclaimed): shown, without a lease.
    let remaining = |v: &Value| int(v).and_then(pttl).filter(|d| *d > Duration::ZERO);
    let kind = text(kind).ok_or_else(bad)?;
    let permit = kind == "permit";
    let mut found: Vec<HolderInfo> = holders
        .chunks(2)
        .filter_map(|pair| match pair {
            [holder, ms] => {
                let mut h = HolderInfo::default();
                if permit {
                    let Value::BulkString(id) = holder else {
                        return None;
                    };
                    h.permit = Some(layout::permit_hex(id));
                } else {
                    h.owner = text(holder);
                }
                h.remaining_lease = remaining(ms);
                Some(h)
            }
            _ => None,
        })
        .collect();
    match kind.as_str() {
        "mutex" | "write" => {
            info.kind = Some(if kind == "write" {
                LockKind::Write
            } else {
                LockKind::Mutex
            });
            info.holder = found.drain(..).next();
            if let Some(holder) = info.holder.as_mut() {
                // The counter as this script read it with the holder: the hold's identity for a
                // break (see `breaking`), which a grant since would have moved.
                holder.hold_id = counter;
            }
        }
        "read" => {
            info.kind = Some(LockKind::Read);
            info.holders = found;
        }
        "permit" => {
            let limit = int(limit)
                .and_then(|l| u32::try_from(l).ok())
                .ok_or_else(bad)?;
            info.kind = Some(LockKind::Permit { limit });
            info.holders = found;
        }
        // Nothing, or a key of another type (not a lock): nothing held as a lock.
        _ => {}
    }
    Ok(info)
}
