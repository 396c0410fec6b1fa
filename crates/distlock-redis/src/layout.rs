//! The on-server layout, all of it: keys, channels, the brace rule, and every Lua script. It is
//! Redisson's `RLock` / `RFencedLock` layout on purpose, so a Java service using Redisson and a Rust
//! service using distlock exclude each other on one name and wake each other's waiters.
//!
//! | what | key or channel | content |
//! |---|---|---|
//! | the lock | `NAME` (the lock name, raw) | a hash: field = owner id, value = hold count (1 for distlock), `PEXPIRE` = lease |
//! | fencing counter | `redisson_lock_token:{NAME}` | an integer, `INCR`ed by every grant |
//! | release channel | `redisson_lock__channel:{NAME}` | `0` published on every release |
//!
//! The `{…}` around `NAME` is Redisson's `prefixName` rule: braces are added only when the name has no
//! `{` already, so that the lock, its counter and its channel hash to one Cluster slot (scripts touch
//! the lock and the counter together, and Cluster refuses multi-key scripts across slots). A name that
//! contains `{` is used as is (`redisson_lock__channel:a{b}c`), and then its own hash tag must be valid
//! (a non-empty `{…}`) for the keys to share a slot: in Cluster mode other such names are refused with
//! `InvalidName`.
//!
//! ```
//! use distlock_redis::layout;
//! assert_eq!(layout::lock_key("orders/42"), "orders/42");
//! assert_eq!(layout::channel("orders/42"), "redisson_lock__channel:{orders/42}");
//! assert_eq!(layout::token_key("orders/42"), "redisson_lock_token:{orders/42}");
//! // A name with braces keeps its own hash tag.
//! assert_eq!(layout::channel("{tenant7}:orders"), "redisson_lock__channel:{tenant7}:orders");
//! assert_eq!(layout::token_key("{tenant7}:orders"), "redisson_lock_token:{tenant7}:orders");
//! // Every key of one lock is in one Cluster slot.
//! for name in ["orders/42", "{tenant7}:orders", "ü"] {
//!     let slot = layout::hash_slot(layout::lock_key(name).as_bytes());
//!     assert_eq!(layout::hash_slot(layout::token_key(name).as_bytes()), slot);
//!     assert_eq!(layout::hash_slot(layout::channel(name).as_bytes()), slot);
//! }
//! assert_eq!(layout::hash_slot(b"123456789"), 12739); // CRC16/XMODEM check value mod 16384
//! ```
//!
//! # Compatibility with Redisson
//!
//! * Owner ids are `<process uuid>:<n>`, the shape of Redisson's `<client uuid>:<thread id>`, so the
//!   hash looks the same to Redisson's tooling (`isLocked`, `isHeldByThread`, `getHoldCount`).
//! * Redisson's acquire (`exists == 0 or hexists == 1` → `hincrby`, `pexpire`; else `pttl`) sees a
//!   distlock-held lock as held (the key exists with another field) and returns its pttl; distlock's
//!   acquire sees a Redisson-held lock the same way.
//! * distlock's release publishes [`UNLOCK_MESSAGE`] (`0`, Redisson's `LockPubSub.UNLOCK_MESSAGE`) on the
//!   channel Redisson's waiters listen to, and distlock's waiters listen where Redisson publishes (with
//!   `PUBLISH`; in Cluster on Redis ≥ 7 both use `SPUBLISH`/`SSUBSCRIBE`). Any message on the channel
//!   wakes a distlock waiter, which then tries again.
//! * distlock keeps the hold count at 1: reentrancy is counted in the process (DESIGN §3), so distlock's
//!   release deletes the key (only if this owner's field is there). Redisson's unlock-latch keys
//!   (`redisson_unlock_latch:…`) are not used: distlock's release is idempotent by itself (a second
//!   release finds no field and reports `NotHeld`). A release *resent* because its connection broke
//!   before the reply came cannot tell whether its first attempt deleted the lock: it reports the
//!   outcome as unknown (`Unavailable`) rather than `NotHeld`.
//! * The fencing counter is `RFencedLock`'s `redisson_lock_token:{NAME}`, incremented in the acquire
//!   script as `RFencedLock` does. Redisson's plain `RLock` does not touch it, so a token minted after a
//!   Redisson `RLock` holder is still greater than every earlier distlock token, but the `RLock` holder
//!   itself has none.

use redis::Script;

/// The message a release publishes: Redisson's `LockPubSub.UNLOCK_MESSAGE`.
pub const UNLOCK_MESSAGE: &str = "0";

/// Prefix of the release channel.
pub const CHANNEL_PREFIX: &str = "redisson_lock__channel";

/// Prefix of the fencing counter key.
pub const TOKEN_PREFIX: &str = "redisson_lock_token";

/// The key of the lock's hash: the name itself, as Redisson's `getRawName()`.
pub fn lock_key(name: &str) -> &str {
    name
}

/// Redisson's `RedissonObject.prefixName`: `prefix:{name}`, or `prefix:name` when the name already has a
/// `{`.
///
/// ```
/// assert_eq!(distlock_redis::layout::prefix_name("p", "x"), "p:{x}");
/// assert_eq!(distlock_redis::layout::prefix_name("p", "a{b}"), "p:a{b}");
/// ```
pub fn prefix_name(prefix: &str, name: &str) -> String {
    // Built from its parts rather than with `format!`: one exact allocation, on every acquire and release.
    let parts = prefixed_parts(prefix, name);
    let mut key = String::with_capacity(parts.iter().map(|part| part.len()).sum());
    for part in parts {
        key.push_str(part);
    }
    key
}

/// The parts of [`prefix_name`]'s key, in order: the one place that knows where the braces go.
fn prefixed_parts<'a>(prefix: &'a str, name: &'a str) -> [&'a str; 4] {
    if name.contains('{') {
        [prefix, ":", name, ""]
    } else {
        [prefix, ":{", name, "}"]
    }
}

/// [`prefix_name`]'s key written straight into a command, without a `String` of its own (issue 9:
/// the token key and the channel go into every acquire and release).
pub(crate) struct PrefixedKey<'a> {
    pub(crate) prefix: &'a str,
    pub(crate) name: &'a str,
}

impl PrefixedKey<'_> {
    pub(crate) fn len(&self) -> usize {
        self.prefix.len() + self.name.len() + 3
    }
}

impl redis::ToRedisArgs for PrefixedKey<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        use std::io::Write as _;
        let mut w = out.writer_for_next_arg();
        for part in prefixed_parts(self.prefix, self.name) {
            // Writes into a Vec, which cannot fail.
            let _ = w.write_all(part.as_bytes());
        }
    }
}

/// The release channel: `redisson_lock__channel:{NAME}`.
pub fn channel(name: &str) -> String {
    prefix_name(CHANNEL_PREFIX, name)
}

/// The fencing counter: `redisson_lock_token:{NAME}`.
pub fn token_key(name: &str) -> String {
    prefix_name(TOKEN_PREFIX, name)
}

/// The part of a key Redis Cluster hashes: the content of the first `{…}` if non-empty, else the key.
pub fn hash_tag(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{') {
        if let Some(len) = key[open + 1..].iter().position(|&b| b == b'}') {
            if len > 0 {
                return &key[open + 1..open + 1 + len];
            }
        }
    }
    key
}

/// The Cluster slot of a key: CRC16/XMODEM of its hash tag, mod 16384.
pub fn hash_slot(key: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in hash_tag(key) {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// Whether the lock's keys share one slot: true unless the name has a `{` but no valid hash tag (then
/// the lock key hashes whole and the prefixed keys hash differently).
///
/// ```
/// use distlock_redis::layout::keys_share_slot;
/// assert!(keys_share_slot("plain"));
/// assert!(keys_share_slot("{t}x"));
/// assert!(!keys_share_slot("x{}y"));
/// assert!(!keys_share_slot("x{y"));
/// ```
pub fn keys_share_slot(name: &str) -> bool {
    let slot = hash_slot(name.as_bytes());
    slot == hash_slot(token_key(name).as_bytes()) && slot == hash_slot(channel(name).as_bytes())
}

/// Acquire. `KEYS[1]` the lock, `KEYS[2]` the token key; `ARGV[1]` the lease in ms, `ARGV[2]` the owner.
/// Returns `{1, token, lease}` on a grant and `{0, 0, pttl}` when held elsewhere (`pttl` −1 for a key
/// without expiry).
///
/// The same test as Redisson's (`exists == 0`, or this owner's field is there), so the two exclude each
/// other. `INCR` runs first, so a counter that is not an integer fails the script before it writes
/// anything. When the field is already this owner's (a retry after a lost reply) the hold is refreshed
/// and a new, greater token minted, as `RFencedLock` does on re-entry. A grant answers the lease it
/// just set rather than asking `PTTL` (a nested call fewer per acquire, issue 9): the script's clock
/// is frozen while it runs (Redis ≥ 7; before, `PTTL` could only be lower by the script's own
/// run time), and the client takes the lower of the reply and the lease anyway.
pub const ACQUIRE: &str = r"
if (redis.call('exists', KEYS[1]) == 0) or (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then
    local token = redis.call('incr', KEYS[2]);
    redis.call('hset', KEYS[1], ARGV[2], 1);
    redis.call('pexpire', KEYS[1], ARGV[1]);
    return {1, token, tonumber(ARGV[1])};
end;
return {0, 0, redis.call('pttl', KEYS[1])};
";

/// Release (also the undo of an abandoned acquire). `KEYS[1]` the lock, `KEYS[2]` the channel;
/// `ARGV[1]` the owner, `ARGV[2]` the publish command (`publish` or `spublish`), `ARGV[3]` the message.
/// Deletes the lock and publishes only if this owner's field is there: 1, else 0.
pub const RELEASE: &str = r"
if (redis.call('hexists', KEYS[1], ARGV[1]) == 0) then
    return 0;
end;
redis.call('del', KEYS[1]);
redis.call(ARGV[2], KEYS[2], ARGV[3]);
return 1;
";

/// Handoff (issue 9): release one owner's hold and grant the lock to the next owner, in one script.
/// `KEYS[1]` the lock, `KEYS[2]` the token key; `ARGV[1]` the releasing owner, `ARGV[2]` the next
/// owner's lease in ms, `ARGV[3]` the next owner. Returns `{1, token, lease}` on a handoff, as
/// [`ACQUIRE`] does on a grant, and `{0, 0, 0}` when the releasing owner's field is not there (expired,
/// taken over): then nothing is written, and the next owner acquires as usual.
///
/// The grant is [`ACQUIRE`]'s, byte for byte on the server: the token `INCR`ed first (a bad counter
/// fails the script before any write, the old hold still there), then the hash with the next owner's
/// field at 1 and its lease. Nothing is published: the lock stays held, so a remote waiter woken here
/// would only find it busy again (DESIGN §9, Redis backend).
pub const HAND_OFF: &str = r"
if (redis.call('hexists', KEYS[1], ARGV[1]) == 0) then
    return {0, 0, 0};
end;
local token = redis.call('incr', KEYS[2]);
redis.call('del', KEYS[1]);
redis.call('hset', KEYS[1], ARGV[3], 1);
redis.call('pexpire', KEYS[1], ARGV[2]);
return {1, token, tonumber(ARGV[2])};
";

/// Renew. `KEYS[1]` the lock; `ARGV[1]` the ttl in ms, `ARGV[2]` the owner. 1 = extended; 0 = held by
/// another owner; −1 = no such key (expired or deleted); −2 = the key holds another type.
pub const RENEW: &str = r"
local t = redis.call('type', KEYS[1]).ok;
if t == 'none' then
    return -1;
end;
if t ~= 'hash' then
    return -2;
end;
if (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then
    redis.call('pexpire', KEYS[1], ARGV[1]);
    return 1;
end;
return 0;
";

/// The scripts, compiled once (redis-rs sends `EVALSHA` and falls back to `EVAL` on `NOSCRIPT`).
#[derive(Debug)]
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) renew: Script,
    pub(crate) hand_off: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Self {
            acquire: Script::new(ACQUIRE),
            release: Script::new(RELEASE),
            renew: Script::new(RENEW),
            hand_off: Script::new(HAND_OFF),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{token_key, PrefixedKey, TOKEN_PREFIX};
    use redis::ToRedisArgs as _;

    /// Written into a command, the key is Redisson's `prefixName`, byte for byte, as `token_key` gives it.
    #[test]
    fn a_prefixed_key_is_the_layouts() {
        for (name, expected) in [
            ("orders/42", "redisson_lock_token:{orders/42}"),
            ("{tenant7}:orders", "redisson_lock_token:{tenant7}:orders"),
            ("a{b", "redisson_lock_token:a{b"),
            ("ü", "redisson_lock_token:{ü}"),
        ] {
            let key = PrefixedKey {
                prefix: TOKEN_PREFIX,
                name,
            };
            assert_eq!(key.to_redis_args(), vec![expected.as_bytes().to_vec()]);
            assert_eq!(token_key(name), expected);
        }
    }
}
