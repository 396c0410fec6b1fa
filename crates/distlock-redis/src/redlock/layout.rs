//! Redlock's on-server layout, all of it: one string key per lock on every node, the value the
//! owner id and a nonce fresh for each acquire (see [`value`]), a `PX` lease. It is the layout of node-redlock (npm `redlock` v5), redis-py's `Lock` and
//! rslock, so their clients and distlock exclude each other on the same name and the same nodes.
//!
//! | what | key | content |
//! |---|---|---|
//! | the lock, on each node | `NAME` (the lock name, raw) | a string: `<owner id>#<16 hex digits>`, `PX` = lease |
//!
//! There is no fencing counter (Redlock mints no token: see the Redlock section of GUARANTEES.md) and
//! no release channel (waiters retry with jitter).
//!
//! **Not the `redis://` lock.** The `redis://` backend keeps Redisson's *hash* at the same key, so
//! `redis://…` and `redlock://…` locks of one name are different locks; where both are used on the same
//! server, the scripts here meet a hash and Redis answers `WRONGTYPE`. That is a clear error (`Protocol`,
//! naming the clash) only when the failed votes make a quorum impossible; otherwise a failed vote, like
//! a node down.
//!
//! # The scripts
//!
//! * **Acquire** ([`ACQUIRE`]) grants when the key is absent *or already holds this acquire's value*
//!   (node-redlock's acquire grants only when absent), so a try resent after a lost reply votes yes on
//!   its own key instead of counting against the quorum. The value is new for every acquire (as
//!   node-redlock's and rslock's random value), so a late release or undo of an earlier hold of the
//!   same `Lock` never matches, and never deletes, a later hold's key. It returns `1`, or the holder's pttl as a
//!   negative number (`-pttl`, or `-1` for a key without expiry) when busy, for `wait`.
//! * **Release** ([`RELEASE`]) deletes the key only if it holds the hold's value (compare-and-delete,
//!   node-redlock's and redis-py's release).
//! * **Extend** ([`EXTEND`]) sets a new `PEXPIRE` only if the key holds the hold's value
//!   (compare-and-pexpire; node-redlock's extend does the same with `SET … PX`), so it never
//!   recreates a key that was deleted.
//! * **Break** ([`BREAK`], `distlock break`) deletes the key only if it still holds the value
//!   `inspect` showed (`HolderInfo::hold_id`: the owner id *and* that acquire's nonce), so a later
//!   hold of the same `Lock` is never broken; given an owner id alone (a holder built by hand), any
//!   value of that owner's. The operator's tool against a dead holder, sent to every node.
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

/// The value one acquire writes on every node: the owner id, `#`, and a nonce of 16 hex digits new for
/// each acquire in this process (a counter from a random start, so two processes with one caller-chosen
/// owner id do not meet either). The retries of one acquire keep it.
pub fn value(owner: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static START: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // std's hasher keys are random per process (seeded from the OS): no dependency for 64 random bits.
    let start = *START.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    });
    let nonce = start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed));
    format!("{owner}#{nonce:016x}")
}

/// The owner id in a value [`value`] made; any other value (another client's random one) as it is.
///
/// ```
/// use distlock_redis::redlock::layout;
/// assert_eq!(layout::owner_of(&layout::value("p:1")), "p:1");
/// assert_eq!(layout::owner_of("9f86d081884c7d65"), "9f86d081884c7d65");
/// ```
pub fn owner_of(value: &str) -> &str {
    match value.rsplit_once('#') {
        Some((owner, nonce))
            if nonce.len() == 16 && nonce.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            owner
        }
        _ => value,
    }
}

/// `KEYS[1]` = lock key, `ARGV[1]` = the acquire's [`value`], `ARGV[2]` = lease in ms. Returns 1 when
/// granted (the key was absent or already this acquire's), else `-pttl` of the holder's key (`-1` when it has no expiry, so
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

/// `KEYS[1]` = lock key, `ARGV[1]` = the hold's [`value`]. Returns 1 when its key was deleted, else 0.
pub const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// `KEYS[1]` = lock key, `ARGV[1]` = the hold's [`value`], `ARGV[2]` = new lease in ms. Returns 1 when its
/// key got the new expiry, else 0 (absent, or another's).
pub const EXTEND: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// Break (`distlock break`): `KEYS[1]` = lock key, `ARGV[1]` = the owner id `inspect` showed (what
/// [`owner_of`] makes of the node's value), `ARGV[2]` (optional) = the whole value `inspect` showed
/// (`HolderInfo::hold_id`: `<owner>#<nonce>`, the value a quorum of nodes held). With `ARGV[2]`,
/// the key is deleted only when it holds that very value: one acquire's, so a later hold of the same
/// owner (a `Lock` that released and acquired again has a new nonce) is never deleted. Without it
/// (a holder built by hand, with an owner id alone), the key is deleted when its value is that
/// owner's, whatever the nonce (as [`owner_of`] reads it: `<owner>#<16 hex digits>`, or a value
/// that is the owner itself): then a later hold of that same owner id is deleted too. Returns 1 when
/// it deleted the key, else 0 (absent, another value, or another owner's).
///
/// ```
/// use distlock_redis::redlock::layout;
/// // Only the lock's key is ever deleted, and only after its value or owner is compared.
/// assert_eq!(layout::BREAK.matches("'DEL'").count(), 1);
/// assert!(layout::BREAK.contains("current ~= ARGV[2]"));
/// assert!(layout::BREAK.contains("owner ~= ARGV[1]"));
/// ```
pub const BREAK: &str = r"
local current = redis.call('GET', KEYS[1])
if current == false then
  return 0
end
if #ARGV >= 2 then
  if current ~= ARGV[2] then
    return 0
  end
else
  local owner = string.match(current, '^(.*)#%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x$')
  if owner == nil then
    owner = current
  end
  if owner ~= ARGV[1] then
    return 0
  end
end
return redis.call('DEL', KEYS[1])
";

/// The scripts, hashed once.
pub(crate) struct Scripts {
    pub(crate) acquire: redis::Script,
    pub(crate) release: redis::Script,
    pub(crate) extend: redis::Script,
    pub(crate) break_holder: redis::Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Self {
            acquire: redis::Script::new(ACQUIRE),
            release: redis::Script::new(RELEASE),
            extend: redis::Script::new(EXTEND),
            break_holder: redis::Script::new(BREAK),
        }
    }
}
