//! Redlock's on-server layout, all of it: one string key per lock on every node, the value the
//! owner id, a `PX` lease. It is the layout of node-redlock (npm `redlock` v5), redis-py's `Lock` and
//! rslock, so their clients and distlock exclude each other on the same name and the same nodes.
//!
//! | what | key | content |
//! |---|---|---|
//! | the lock, on each node | `NAME` (the lock name, raw) | a string: the owner id, `PX` = lease |
//!
//! There is no fencing counter (Redlock mints no token: see the Redlock section of GUARANTEES.md) and
//! no release channel (waiters retry with jitter).
//!
//! **Not the `redis://` lock.** The `redis://` backend keeps Redisson's *hash* at the same key, so
//! `redis://…` and `redlock://…` locks of one name are different locks; where both are used on the same
//! server, the scripts here meet a hash and Redis answers `WRONGTYPE`: a failed vote, like a node down.
//! When the failed votes leave no quorum possible, the acquire fails with a `Protocol` error saying so.
//!
//! # The scripts
//!
//! * **Acquire** ([`ACQUIRE`]) grants when the key is absent *or already holds this owner's value*
//!   (node-redlock's acquire grants only when absent), so a try resent after a lost reply votes yes on
//!   its own key instead of counting against the quorum. It returns `1`, or the holder's pttl as a
//!   negative number (`-pttl`, or `-1` for a key without expiry) when busy, for `wait`.
//! * **Release** ([`RELEASE`]) deletes the key only if it holds the owner's value (compare-and-delete,
//!   node-redlock's and redis-py's release).
//! * **Extend** ([`EXTEND`]) sets a new `PEXPIRE` only if the key holds the owner's value
//!   (compare-and-pexpire; node-redlock's extend does the same with `SET … PX`).
//!
//! ```
//! use distlock_redis::redlock::layout;
//! assert_eq!(layout::lock_key("orders/42"), "orders/42");
//! assert!(layout::ACQUIRE.contains("'PX'"));
//! ```

/// The lock's key on every node: the name itself, as node-redlock and redis-py use it.
pub fn lock_key(name: &str) -> &str {
    name
}

/// `KEYS[1]` = lock key, `ARGV[1]` = owner, `ARGV[2]` = lease in ms. Returns 1 when granted (the key was
/// absent or already this owner's), else `-pttl` of the holder's key (`-1` when it has no expiry, so
/// that a busy reply is never 0 or positive).
pub const ACQUIRE: &str = r"
local current = redis.call('GET', KEYS[1])
if current == false or current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl < 1 then
  return -1
end
return -pttl
";

/// `KEYS[1]` = lock key, `ARGV[1]` = owner. Returns 1 when this owner's key was deleted, else 0.
pub const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// `KEYS[1]` = lock key, `ARGV[1]` = owner, `ARGV[2]` = new lease in ms. Returns 1 when this owner's key
/// got the new expiry, else 0 (absent, or another owner's).
pub const EXTEND: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// The scripts, hashed once.
pub(crate) struct Scripts {
    pub(crate) acquire: redis::Script,
    pub(crate) release: redis::Script,
    pub(crate) extend: redis::Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Self {
            acquire: redis::Script::new(ACQUIRE),
            release: redis::Script::new(RELEASE),
            extend: redis::Script::new(EXTEND),
        }
    }
}
