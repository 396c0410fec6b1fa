//! The on-server layout, all of it: keys, channels, the brace rule, and every Lua script. It is
//! Redisson's `RLock` / `RFencedLock`, `RReadWriteLock` and `RPermitExpirableSemaphore` layout on
//! purpose, so a Java service using Redisson and a Rust service using distlock exclude each other on
//! one name (of one kind) and wake each other's waiters.
//!
//! | what | key or channel | content |
//! |---|---|---|
//! | the lock | `NAME` (the lock name, raw) | a hash: field = owner id, value = hold count (1 for distlock), `PEXPIRE` = lease |
//! | fencing counter | `redisson_lock_token:{NAME}` | an integer, `INCR`ed by every mutex, write and permit grant |
//! | release channel | `redisson_lock__channel:{NAME}` | `0` published on every release |
//! | read-write lock | `NAME` | a hash: `mode` = `read` or `write`; field `<owner>` = a reader's hold count (1 for distlock); field `<owner>:write` = the writer's; `PEXPIRE` = the longest lease |
//! | a reader's hold *k* | `{NAME}:<owner>:rwlock_timeout:<k>` | `1`, `PEXPIRE` = that reader's lease (distlock: `k` = 1) |
//! | read-write channel | `redisson_rwlock:{NAME}` | `0` on the last reader's release, `1` on a writer's release and a downgrade |
//! | semaphore | `NAME` | an integer string: the permits available (no expiry: kept with the limit) |
//! | its permits | `{NAME}:timeout` | a sorted set: member = a permit id's 16 raw bytes, score = its expiry in epoch ms (the server's `TIME` for distlock's) |
//! | semaphore channel | `redisson_sc:{NAME}` | the new count of available permits, on every release and reclaim |
//! | plain layout's lock (`?layout=plain`) | `NAME` | a string: the owner id, `PX` = lease (redis-py's `Lock`, rslock) |
//! | its release channel | `distlock_lock__channel:{NAME}` | `0` published on every distlock release |
//!
//! A name is one kind at a time: a hash without `mode` is a mutex, a hash with `mode` a read-write
//! lock, an integer string a semaphore, and every acquire script answers [`KIND_CONFLICT`] for
//! another kind's object instead of a grant (Redisson's own `RLock` sees a read-write lock's hash as
//! held). A semaphore's limit is the counter plus the permits held (Redisson's `getPermits`), set with
//! the first permit and kept as long as the counter: to use another limit, or the name as another
//! kind, delete `NAME` and `{NAME}:timeout` while no permit is held (or call Redisson's `setPermits`).
//!
//! An operator's break (`distlock break`, [`BREAK`]) deletes `NAME` when it holds the exclusive hold
//! (a mutex's field, a writer's `<owner>:write`, or a plain lock's value) of the owner `inspect`
//! showed and, when `inspect` showed a hold id (the token counter's value, read with the holder), the
//! counter has not moved since (no grant came in between: a `Lock` that released and acquired again is
//! not broken), and publishes what a release of that hold would (a fair queue's head woken too); the
//! token counter is only read. Holders that mint no token (Redisson's `RLock`, `tokens=false`) are
//! matched by owner id alone. Readers and permits are not broken.
//!
//! ```
//! use distlock_redis::layout;
//! let owner = "7c9e6679-7425-40de-944b-e07fc1f90ae7:1";
//! assert_eq!(layout::rw_channel("cfg"), "redisson_rwlock:{cfg}");
//! assert_eq!(layout::write_field(owner), format!("{owner}:write"));
//! assert_eq!(
//!     layout::read_timeout_prefix("cfg", owner),
//!     format!("{{cfg}}:{owner}:rwlock_timeout")
//! );
//! assert_eq!(layout::suffix_base("cfg"), "{cfg}");
//! assert_eq!(layout::semaphore_channel("workers"), "redisson_sc:{workers}");
//! assert_eq!(layout::semaphore_timeout_key("workers"), "{workers}:timeout");
//! // A name with braces keeps its own hash tag in every key.
//! assert_eq!(layout::semaphore_timeout_key("{t}w"), "{t}w:timeout");
//! assert_eq!(layout::read_timeout_prefix("{t}c", "o:1"), "{t}c:o:1:rwlock_timeout");
//! // A permit id: 16 bytes from the owner, shown as 32 hex digits (Redisson's form).
//! let id = layout::permit_id(owner);
//! assert_eq!(layout::permit_hex(&id).len(), 32);
//! assert_ne!(id, layout::permit_id("7c9e6679-7425-40de-944b-e07fc1f90ae7:2"));
//! // Every key of each kind is in the name's Cluster slot.
//! for name in ["cfg", "{t}c", "ü"] {
//!     let slot = layout::hash_slot(name.as_bytes());
//!     for key in [
//!         layout::rw_channel(name),
//!         layout::read_timeout_prefix(name, owner) + ":1",
//!         layout::semaphore_channel(name),
//!         layout::semaphore_timeout_key(name),
//!     ] {
//!         assert_eq!(layout::hash_slot(key.as_bytes()), slot, "{key}");
//!     }
//! }
//! ```
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

/// Prefix of the plain layout's release channel.
pub const PLAIN_CHANNEL_PREFIX: &str = "distlock_lock__channel";

/// The plain layout's release channel: `distlock_lock__channel:{NAME}`.
pub fn plain_channel(name: &str) -> String {
    prefix_name(PLAIN_CHANNEL_PREFIX, name)
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

/// Whether the lock's keys (of every kind) share one slot: true unless the name has a `{` but no valid
/// hash tag (then the lock key hashes whole and the prefixed and suffixed keys hash differently).
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
    [
        token_key(name),
        channel(name),
        plain_channel(name),
        queue_key(name),
        queue_timeout_key(name),
        waiter_channel(name, "owner"),
        rw_channel(name),
        suffix_base(name),
        semaphore_channel(name),
        semaphore_timeout_key(name),
    ]
    .iter()
    .all(|key| hash_slot(key.as_bytes()) == slot)
}

// The text of [`ACQUIRE`], for `concat!` into the fair scripts that wrap it.
macro_rules! acquire_lua {
    () => {
        r"
if (redis.call('exists', KEYS[1]) == 0) or (redis.pcall('hexists', KEYS[1], ARGV[2]) == 1) then
    local token = redis.call('incr', KEYS[2]);
    redis.call('hset', KEYS[1], ARGV[2], 1);
    redis.call('pexpire', KEYS[1], ARGV[1]);
    return {1, token, tonumber(ARGV[1])};
end;
local t = redis.call('type', KEYS[1]).ok;
if t == 'hash' then
    if redis.call('hexists', KEYS[1], 'mode') == 1 then
        return {-1, 2, 0};
    end;
    return {0, 0, redis.call('pttl', KEYS[1])};
end;
if t == 'string' and tonumber(redis.call('get', KEYS[1])) ~= nil then
    return {-1, 3, 0};
end;
return redis.call('hexists', KEYS[1], ARGV[2]);
"
    };
}

/// Acquire. `KEYS[1]` the lock, `KEYS[2]` the token key; `ARGV[1]` the lease in ms, `ARGV[2]` the owner.
/// Returns `{1, token, lease}` on a grant and `{0, 0, pttl}` when held elsewhere (`pttl` −1 for a key
/// without expiry); `{-1, 2, 0}` when the name is a read-write lock's hash (it has a `mode` field) and
/// `{-1, 3, 0}` when it is a semaphore's permit counter (an integer string): [`KIND_CONFLICT`], never a
/// grant beside them. Any other type at the key fails the script with the server's `WRONGTYPE`.
///
/// The same test as Redisson's (`exists == 0`, or this owner's field is there), so the two exclude each
/// other. Only a busy try asks what holds the name (`TYPE`, and `mode` in a hash), so a grant runs the
/// same nested calls as before (`hexists` through `pcall`: on a string it answers an error, not 1, and
/// the busy branch says what the string is). `INCR` runs first, so a counter that is not an integer
/// fails the script before it writes anything. When the field is already this owner's (a retry after a lost reply) the hold is refreshed
/// and a new, greater token minted, as `RFencedLock` does on re-entry. A grant answers the lease it
/// just set rather than asking `PTTL` (a nested call fewer per acquire, issue 9): the script's clock
/// is frozen while it runs (Redis ≥ 7; before, `PTTL` could only be lower by the script's own
/// run time), and the client takes the lower of the reply and the lease anyway.
pub const ACQUIRE: &str = acquire_lua!();

// The text of [`RELEASE`], for `concat!` into the fair scripts that wrap it.
macro_rules! release_lua {
    () => {
        r"
if (redis.pcall('hexists', KEYS[1], ARGV[1]) ~= 1) then
    return 0;
end;
redis.call('del', KEYS[1]);
redis.call(ARGV[2], ARGV[4], ARGV[3]);
return 1;
"
    };
}

/// Release (also the undo of an abandoned acquire). `KEYS[1]` the lock; `ARGV[1]` the owner, `ARGV[2]`
/// the publish command (`publish` or `spublish`), `ARGV[3]` the message, `ARGV[4]` the channel.
/// Deletes the lock and publishes only if this owner's field is there: 1, else 0 (also when the key now
/// holds another kind's type: `pcall`, so a semaphore's counter there is "not held", not `WRONGTYPE`).
///
/// The channel is an argument, not a key (Redisson's unlock script declares it as `KEYS[2]`): in
/// Cluster, a slot under migration serves a script only if every key it declares is on the node
/// (else `TRYAGAIN`), and a channel is never a key anywhere, so a release declaring it could not run
/// on either node until the migration ended. The channel is in the lock's slot (see
/// [`keys_share_slot`]), which Cluster checks for a script's undeclared keys too.
pub const RELEASE: &str = release_lua!();

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

// ---------------------------------------------------------------------------------------------
// The plain layout (`?layout=plain`): redis-py's `Lock`, rslock and node-redlock's string key.
//
// | what | key or channel | content |
// |---|---|---|
// | the lock | `NAME` | a string: the owner id (redis-py: its token), `PX` = lease |
// | fencing counter | `redisson_lock_token:{NAME}` | the same counter as the Redisson layout's, so tokens keep rising when a deployment changes layout |
// | release channel | `distlock_lock__channel:{NAME}` | `0` published on every distlock release |
//
// redis-py's acquire is `SET NAME token NX PX lease`, its release a script that deletes the key only
// while it holds the token; a distlock holder's value is its owner id, so each sees the other's key as
// held. redis-py publishes nothing, so a distlock waiter also tries again every `poll`.

// The text of [`PLAIN_ACQUIRE`], for `concat!` into the fair scripts that wrap it.
macro_rules! plain_acquire_lua {
    () => {
        r"
local held = redis.pcall('get', KEYS[1]);
if held == false or held == ARGV[2] then
    local token = 0;
    if ARGV[3] ~= '0' then
        token = redis.call('incr', KEYS[2]);
    end;
    redis.call('set', KEYS[1], ARGV[2], 'px', ARGV[1]);
    return {1, token, tonumber(ARGV[1])};
end;
if type(held) == 'table' then
    if redis.call('type', KEYS[1]).ok == 'hash' then
        if redis.call('hexists', KEYS[1], 'mode') == 1 then
            return {-1, 2, 0};
        end;
        return redis.error_reply('WRONGTYPE the lock is a hash: a client with layout=redisson holds it');
    end;
    return held;
end;
local pttl = redis.call('pttl', KEYS[1]);
if pttl == -1 and string.match(held, '^%d+$') then
    return {-1, 3, 0};
end;
return {0, 0, pttl};
"
    };
}

/// Plain acquire. `KEYS[1]` the lock, `KEYS[2]` the token key; `ARGV[1]` the lease in ms, `ARGV[2]`
/// the owner, `ARGV[3]` `0` not to mint a token (`tokens=false`: the counter is not touched, and the
/// token answered is 0; anything else, or nothing, mints). `{1, token, lease}` on a grant, `{0, 0, pttl}` while another value is there (`pttl` −1
/// for a key without expiry: redis-py's lock without a timeout); [`KIND_CONFLICT`] for a read-write
/// lock's hash (`{-1, 2, 0}`) or a semaphore's counter (`{-1, 3, 0}`: digits only, and no expiry, as
/// the counter keeps its limit; another client's lock value may be digits too, `SET lock 1 NX PX`, or
/// read as a number by Lua's `tonumber` — `1e5`, `0x1f`, a NUL after digits — and is waited for as
/// held, never taken for a semaphore); a hash without `mode` (a mutex
/// in Redisson's layout: a client with the other layout) fails with `WRONGTYPE`, as Redisson's
/// layout's acquire does on a plain key, so the two never both grant.
///
/// `GET` first (through `pcall`: on a hash it answers an error, not the owner), then `INCR`, then
/// `SET … PX`: a counter that is not an integer fails the script before it writes. A value that is
/// already this owner's is a resend after a lost reply: the hold is refreshed and a new token minted,
/// as the Redisson layout's acquire does.
///
/// ```
/// use distlock_redis::layout;
/// assert_eq!(layout::plain_channel("orders/42"), "distlock_lock__channel:{orders/42}");
/// assert_eq!(layout::plain_channel("{t}o"), "distlock_lock__channel:{t}o");
/// // The plain layout's keys share the name's Cluster slot too.
/// for name in ["orders/42", "{t}o"] {
///     let slot = layout::hash_slot(name.as_bytes());
///     assert_eq!(layout::hash_slot(layout::plain_channel(name).as_bytes()), slot);
/// }
/// // redis-py's and rslock's acquire is one `SET NX PX`; the script's grant writes the same.
/// assert!(layout::PLAIN_ACQUIRE.contains("redis.call('set', KEYS[1], ARGV[2], 'px', ARGV[1])"));
/// ```
pub const PLAIN_ACQUIRE: &str = plain_acquire_lua!();

// The text of [`PLAIN_RELEASE`], for `concat!` into the fair scripts that wrap it.
macro_rules! plain_release_lua {
    () => {
        r"
if redis.pcall('get', KEYS[1]) ~= ARGV[1] then
    return 0;
end;
redis.call('del', KEYS[1]);
redis.call(ARGV[2], ARGV[4], ARGV[3]);
return 1;
"
    };
}

/// Plain release (also the undo of an abandoned acquire). `KEYS[1]` the lock; `ARGV[1]` the owner,
/// `ARGV[2]` the publish command, `ARGV[3]` the message, `ARGV[4]` the channel (an argument: see
/// [`RELEASE`]). Deletes the key and publishes only while its value is this owner's: 1, else 0
/// (another type there: `pcall`, "not held"). redis-py's release script, plus the publish.
pub const PLAIN_RELEASE: &str = plain_release_lua!();

/// Plain renew. `KEYS[1]` the lock; `ARGV[1]` the ttl in ms, `ARGV[2]` the owner. As [`RENEW`]: 1 =
/// extended; 0 = another value; −1 = no such key; −2 = the key holds another type.
pub const PLAIN_RENEW: &str = r"
local held = redis.pcall('get', KEYS[1]);
if held == ARGV[2] then
    redis.call('pexpire', KEYS[1], ARGV[1]);
    return 1;
end;
if held == false then
    return -1;
end;
if type(held) == 'table' then
    return -2;
end;
return 0;
";

/// Plain handoff: [`HAND_OFF`] on the string key. `KEYS[1]` the lock, `KEYS[2]` the token key;
/// `ARGV[1]` the releasing owner, `ARGV[2]` the next owner's lease in ms, `ARGV[3]` the next owner,
/// `ARGV[4]` `0` not to mint a token (as [`PLAIN_ACQUIRE`]'s `ARGV[3]`). `{1, token, lease}`, or
/// `{0, 0, 0}` (nothing written) when the key is not the releasing owner's.
pub const PLAIN_HAND_OFF: &str = r"
if redis.pcall('get', KEYS[1]) ~= ARGV[1] then
    return {0, 0, 0};
end;
local token = 0;
if ARGV[4] ~= '0' then
    token = redis.call('incr', KEYS[2]);
end;
redis.call('set', KEYS[1], ARGV[3], 'px', ARGV[2]);
return {1, token, tonumber(ARGV[2])};
";

// ---------------------------------------------------------------------------------------------
// Fair mode (`?fair=true`, issue 27): a queue of waiters beside either layout's mutex.
//
// | what | key or channel | content |
// |---|---|---|
// | the queue | `distlock_lock_queue:{NAME}` | a list: waiting owners in the order the server queued them |
// | their liveness | `distlock_lock_timeout:{NAME}` | a sorted set: member = a waiting owner, score = its deadline (the server's `TIME`, ms) |
// | a waiter's channel | `distlock_fair__channel:{NAME}:<owner>` | `0`, published to the queue's head when the lock is free |
//
// A waiter joins at its first busy try (a `try_acquire` that will not wait too: its undo takes the
// place off), and each of its tries refreshes its deadline ([`FAIR_LIVENESS`] ahead): a waiter
// that stops trying (killed, cut off) is dropped by the next script that runs once its deadline has
// passed. Only the head may take a free lock; every fair release and every leave publishes to the
// head. Both keys expire [`FAIR_LIVENESS`] after the last waiter's try, so a queue whose waiters all
// died leaves nothing behind. The lock key stays the layout's own: a client that is not fair
// (Redisson's `RLock`, distlock without `fair=true`) still excludes fair clients, and may take a
// free lock ahead of the queue.

/// Prefix of the fair queue.
pub const QUEUE_PREFIX: &str = "distlock_lock_queue";

/// Prefix of the fair queue's deadlines.
pub const QUEUE_TIMEOUT_PREFIX: &str = "distlock_lock_timeout";

/// Prefix of a fair waiter's own channel.
pub const WAITER_CHANNEL_PREFIX: &str = "distlock_fair__channel";

/// How long a fair waiter stays in the queue after its last try: it tries at least every
/// [`FAIR_HEARTBEAT`], so a live waiter keeps its place with room to spare, and a dead one holds the
/// queue up for at most this long (the waiter behind it tries again when the deadline passes).
pub const FAIR_LIVENESS: std::time::Duration = std::time::Duration::from_millis(2500);

/// How often a fair waiter tries at the latest while it waits (jittered to ½–1× of it): each try
/// refreshes its place in the queue.
pub const FAIR_HEARTBEAT: std::time::Duration = std::time::Duration::from_millis(1200);

/// A fair-mode key or channel: `prefix:{NAME}`, or `prefix::NAME` when the name has a `{` (it keeps
/// its own hash tag). Not Redisson's `prefixName`, which spells `n` and `{n}` alike
/// (`prefix:{n}`): these keys are distlock's own, and two names must never share a queue.
fn fair_name(prefix: &str, name: &str) -> String {
    if name.contains('{') {
        format!("{prefix}::{name}")
    } else {
        format!("{prefix}:{{{name}}}")
    }
}

/// The fair queue: `distlock_lock_queue:{NAME}` (`distlock_lock_queue::NAME` for a name with a `{`).
///
/// ```
/// use distlock_redis::layout;
/// assert_eq!(layout::queue_key("jobs"), "distlock_lock_queue:{jobs}");
/// assert_eq!(layout::queue_timeout_key("jobs"), "distlock_lock_timeout:{jobs}");
/// assert_eq!(layout::waiter_channel("jobs", "u:1"), "distlock_fair__channel:{jobs}:u:1");
/// assert_eq!(layout::waiter_channel("{t}j", "u:1"), "distlock_fair__channel::{t}j:u:1");
/// // `n` and `{n}` are two locks, with two queues (Redisson's prefix rule would spell both `…:{n}`).
/// assert_ne!(layout::queue_key("n"), layout::queue_key("{n}"));
/// assert_ne!(layout::queue_timeout_key("n"), layout::queue_timeout_key("{n}"));
/// assert_ne!(layout::waiter_channel_prefix("n"), layout::waiter_channel_prefix("{n}"));
/// for name in ["jobs", "{t}j", "{n}"] {
///     let slot = layout::hash_slot(name.as_bytes());
///     for key in [layout::queue_key(name), layout::queue_timeout_key(name), layout::waiter_channel(name, "u:1")] {
///         assert_eq!(layout::hash_slot(key.as_bytes()), slot, "{key}");
///     }
/// }
/// ```
pub fn queue_key(name: &str) -> String {
    fair_name(QUEUE_PREFIX, name)
}

/// The fair queue's deadlines: `distlock_lock_timeout:{NAME}` (`…::NAME` for a name with a `{`).
pub fn queue_timeout_key(name: &str) -> String {
    fair_name(QUEUE_TIMEOUT_PREFIX, name)
}

/// What precedes the owner in a fair waiter's channel: `distlock_fair__channel:{NAME}:`
/// (`…::NAME:` for a name with a `{`).
pub fn waiter_channel_prefix(name: &str) -> String {
    let mut channel = fair_name(WAITER_CHANNEL_PREFIX, name);
    channel.push(':');
    channel
}

/// A fair waiter's own channel: `distlock_fair__channel:{NAME}:<owner>`.
pub fn waiter_channel(name: &str, owner: &str) -> String {
    let mut channel = waiter_channel_prefix(name);
    channel.push_str(owner);
    channel
}

// Lua, the start of every fair script: `now` from the server's clock, `leave(owner)` (an owner off
// the queue, if it is there: the count taken off the list), the waiters whose deadline has passed
// dropped, and then any head without a deadline (the two keys should agree, but either may be lost
// alone: evicted, deleted by hand), so the queue mends itself (`queue` and `deadlines` are the
// script's keys). An owner is in the list once (a join checks with `LPOS`).
macro_rules! fair_prelude_lua {
    () => {
        r"
local time = redis.call('time');
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000);
local function leave(owner)
    redis.call('zrem', deadlines, owner);
    return redis.call('lrem', queue, 1, owner);
end;
for _, waiter in ipairs(redis.call('zrangebyscore', deadlines, '-inf', now)) do
    leave(waiter);
end;
while true do
    local first = redis.call('lindex', queue, 0);
    if first == false or redis.call('zscore', deadlines, first) ~= false then
        break;
    end;
    redis.call('lpop', queue);
end;
"
    };
}

// Lua, a fair acquire around the layout's acquire (`acquire()`, `KEYS[1]`, `KEYS[2]`, `ARGV[1..3]`).
macro_rules! fair_acquire_lua {
    ($acquire:expr) => {
        concat!(
            "local queue, deadlines = KEYS[3], KEYS[4];\n",
            fair_prelude_lua!(),
            r"
local function join()
    redis.call('zadd', deadlines, now + tonumber(ARGV[4]), ARGV[2]);
    local position = redis.call('lpos', queue, ARGV[2]);
    if position == false then
        position = redis.call('rpush', queue, ARGV[2]) - 1;
    end;
    redis.call('pexpire', queue, ARGV[4]);
    redis.call('pexpire', deadlines, ARGV[4]);
    return position;
end;
local head = redis.call('lindex', queue, 0);
local mine = redis.pcall('hexists', KEYS[1], ARGV[2]) == 1 or redis.pcall('get', KEYS[1]) == ARGV[2];
if head and head ~= ARGV[2] and not mine then
    local position = join();
    local wait = redis.call('pttl', KEYS[1]);
    if position == 1 or wait < 0 then
        -- The prelude left no head without a deadline.
        local head_left = tonumber(redis.call('zscore', deadlines, head)) - now + 1;
        if wait < 0 or head_left < wait then
            wait = head_left;
        end;
    end;
    return {0, position, wait};
end;
local function acquire()
",
            $acquire,
            r"
end;
local reply = acquire();
if type(reply) == 'table' and reply[1] == 1 then
    leave(ARGV[2]);
elseif type(reply) == 'table' and reply[1] == 0 then
    reply[2] = join();
end;
return reply;
"
        )
    };
}

// Lua, a fair release around the layout's release (`release()`, `KEYS[1]`, `ARGV[1..4]`).
macro_rules! fair_release_lua {
    ($release:expr) => {
        concat!(
            "local queue, deadlines = KEYS[2], KEYS[3];\n",
            fair_prelude_lua!(),
            "local function release()\n",
            $release,
            r"
end;
local released = release();
local left = leave(ARGV[1]);
if (released == 1 or left > 0) and redis.call('exists', KEYS[1]) == 0 then
    local head = redis.call('lindex', queue, 0);
    if head then
        redis.call(ARGV[2], ARGV[5] .. head, ARGV[3]);
    end;
end;
return released;
"
        )
    };
}

/// Fair acquire, Redisson's layout: [`ACQUIRE`] behind the queue. `KEYS[1]` the lock, `KEYS[2]` the
/// token key, `KEYS[3]` [`queue_key`], `KEYS[4]` [`queue_timeout_key`]; `ARGV[1]` the lease in ms,
/// `ARGV[2]` the owner, `ARGV[3]` unused (the plain layout's mint flag), `ARGV[4]` the liveness in ms
/// ([`FAIR_LIVENESS`]). Waiters past their deadline are
/// dropped first. While another live waiter heads the queue (and the lock is not already this
/// owner's: a resend after a lost reply), the answer is busy without a try: `{0, position, ms}`, `ms`
/// the lock's pttl, or the head's remaining liveness when the lock is free or this owner is next.
/// Otherwise [`ACQUIRE`] runs: a grant takes this owner off the queue, a busy answer joins
/// (or refreshes) its place and carries its position (0 = the head).
///
/// ```
/// use distlock_redis::layout;
/// assert!(layout::FAIR_ACQUIRE.contains(layout::ACQUIRE));
/// assert!(layout::FAIR_PLAIN_ACQUIRE.contains(layout::PLAIN_ACQUIRE));
/// assert!(layout::FAIR_RELEASE.contains(layout::RELEASE));
/// assert!(layout::FAIR_PLAIN_RELEASE.contains(layout::PLAIN_RELEASE));
/// ```
pub const FAIR_ACQUIRE: &str = fair_acquire_lua!(acquire_lua!());

/// Fair acquire, the plain layout: [`PLAIN_ACQUIRE`] behind the queue, with [`FAIR_ACQUIRE`]'s keys
/// and arguments (`ARGV[3]` the mint flag).
pub const FAIR_PLAIN_ACQUIRE: &str = fair_acquire_lua!(plain_acquire_lua!());

/// Fair release (also the undo of a fair acquire, and a waiter's leave): [`RELEASE`], then this owner
/// taken off the queue if it is there, and, when the lock is free after that and this script freed it
/// or left the queue, `0` published to the head's own channel. `KEYS[1]` the lock, `KEYS[2]`
/// [`queue_key`], `KEYS[3]` [`queue_timeout_key`]; `ARGV[1..4]` [`RELEASE`]'s, `ARGV[5]`
/// [`waiter_channel_prefix`]. Answers [`RELEASE`]'s 1 or 0.
pub const FAIR_RELEASE: &str = fair_release_lua!(release_lua!());

/// Fair release, the plain layout: [`PLAIN_RELEASE`] with [`FAIR_RELEASE`]'s queue steps.
pub const FAIR_PLAIN_RELEASE: &str = fair_release_lua!(plain_release_lua!());

// ---------------------------------------------------------------------------------------------
// Read-write lock: Redisson's `RReadWriteLock` (RedissonReadLock.java, RedissonWriteLock.java,
// renewal/ReadLockTask.java).

/// What one acquire script says when the name is in use as another kind: `{KIND_CONFLICT, kind, 0}`,
/// `kind` one of [`IN_USE_MUTEX`], [`IN_USE_READ_WRITE`], [`IN_USE_SEMAPHORE`].
pub const KIND_CONFLICT: i64 = -1;

/// What the permit acquire script says when the semaphore's limit is not the one asked for:
/// `{LIMIT_MISMATCH, stored limit, 0}`.
pub const LIMIT_MISMATCH: i64 = -2;

/// The name is a mutex: a hash without `mode` (Redisson's `RLock`).
pub const IN_USE_MUTEX: i64 = 1;
/// The name is a read-write lock: a hash with `mode` (Redisson's `RReadWriteLock`).
pub const IN_USE_READ_WRITE: i64 = 2;
/// The name is a semaphore: an integer string, its available permits (Redisson's
/// `RPermitExpirableSemaphore`).
pub const IN_USE_SEMAPHORE: i64 = 3;

/// A write release's message: Redisson's `LockPubSub.READ_UNLOCK_MESSAGE` (its waiters all wake).
pub const READ_UNLOCK_MESSAGE: &str = "1";

/// Prefix of the read-write lock's channel.
pub const RW_CHANNEL_PREFIX: &str = "redisson_rwlock";

/// What follows the owner in the write side's field: `<owner>:write`.
pub const WRITE_SUFFIX: &str = ":write";

/// What follows `<owner>` in a read hold's timeout keys: `{NAME}:<owner>:rwlock_timeout:<k>`.
pub const RW_TIMEOUT_SUFFIX: &str = ":rwlock_timeout";

/// Redisson's `RedissonObject.suffixName`: `{name}:suffix`, or `name:suffix` when the name already has a
/// `{` (the mirror of [`prefix_name`], so both keep the name's hash tag).
///
/// ```
/// assert_eq!(distlock_redis::layout::suffix_name("x", "timeout"), "{x}:timeout");
/// assert_eq!(distlock_redis::layout::suffix_name("a{b}", "timeout"), "a{b}:timeout");
/// ```
pub fn suffix_name(name: &str, suffix: &str) -> String {
    let mut key = suffix_base(name);
    key.push(':');
    key.push_str(suffix);
    key
}

/// The part of [`suffix_name`] before `:suffix`: `{NAME}`, or the name when it has a `{`. Redisson
/// passes it to its read release as the prefix of every reader's timeout keys (`getKeyPrefix`).
///
/// ```
/// assert_eq!(distlock_redis::layout::suffix_base("x"), "{x}");
/// assert_eq!(distlock_redis::layout::suffix_base("{t}x"), "{t}x");
/// ```
pub fn suffix_base(name: &str) -> String {
    if name.contains('{') {
        name.to_string()
    } else {
        let mut key = String::with_capacity(name.len() + 2);
        key.push('{');
        key.push_str(name);
        key.push('}');
        key
    }
}

/// The read-write lock's channel: `redisson_rwlock:{NAME}`.
pub fn rw_channel(name: &str) -> String {
    prefix_name(RW_CHANNEL_PREFIX, name)
}

/// The write side's field in the hash: `<owner>:write` (the read side's is the owner itself).
pub fn write_field(owner: &str) -> String {
    let mut field = String::with_capacity(owner.len() + WRITE_SUFFIX.len());
    field.push_str(owner);
    field.push_str(WRITE_SUFFIX);
    field
}

/// The prefix of a reader's timeout keys: `{NAME}:<owner>:rwlock_timeout` (Redisson's
/// `getReadWriteTimeoutNamePrefix`); hold *k* has the key `…:k`, distlock's one hold `…:1`.
pub fn read_timeout_prefix(name: &str, owner: &str) -> String {
    let mut key = suffix_name(name, owner);
    key.push_str(RW_TIMEOUT_SUFFIX);
    key
}

// The text of [`ELSEWHERE`], for `concat!` into the scripts that start with it.
macro_rules! elsewhere_lua {
    () => {
        r"
local function elsewhere(keys)
    for i = 1, #keys, 100 do
        local r = redis.pcall('exists', KEYS[1], unpack(keys, i, math.min(i + 99, #keys)));
        if type(r) == 'table' then
            if string.find(tostring(r.err), 'non local key', 1, true) then
                return redis.error_reply('TRYAGAIN a key of this lock is on the other node of its slot migration');
            end;
            return r;
        end;
    end;
    return nil;
end;
"
    };
}

/// Lua, the start of every script that touches keys it cannot declare (a reader's timeout keys, found
/// in the hash or named by an argument): `elsewhere(keys)` is `nil` when every one of `keys` is on
/// this node, else the reply the script gives instead, before its first write: `TRYAGAIN`, which
/// distlock's client sends again (within the request's timeout), or another error, passed on.
///
/// In Cluster, a slot under migration has each of its keys on one of two nodes; Redis runs a script
/// there only if every key it *declares* is on the node (else `TRYAGAIN`, or `ASK` when none is), and
/// a key the script did not declare is not checked the same way: on the source, a command on one that
/// has moved fails the script half-way ("non local key"); on the target (after `ASKING`), a command on
/// one that has not moved yet runs on nothing (a reader still holding would look expired). A command
/// on several keys is checked on both nodes (refused if one of them is not there), so
/// `EXISTS KEYS[1] key…` tells, without writing anything. Outside a migration it always runs: a missing
/// key is just missing. So a script sees all its keys or answers `TRYAGAIN`: during a migration it
/// waits until the keys it needs are on one node (at the latest, the hand-over), never a wrong answer.
///
/// ```
/// use distlock_redis::layout;
/// // Every script that reads or writes a reader's timeout keys starts with it.
/// for script in [
///     layout::READ_ACQUIRE,
///     layout::READ_RELEASE,
///     layout::DOWNGRADE,
///     layout::READ_RENEW,
///     layout::INSPECT,
/// ] {
///     assert!(script.starts_with(layout::ELSEWHERE));
/// }
/// // The others touch only what they declare.
/// for script in [layout::ACQUIRE, layout::RELEASE, layout::WRITE_ACQUIRE, layout::PERMIT_ACQUIRE] {
///     assert!(!script.contains("elsewhere"));
/// }
/// ```
pub const ELSEWHERE: &str = elsewhere_lua!();

/// Read acquire. `KEYS[1]` the lock, `KEYS[2]` the token key; `ARGV[1]` the lease in ms, `ARGV[2]` the
/// owner, `ARGV[3]` its write field, `ARGV[4]` its timeout prefix ([`read_timeout_prefix`]).
/// `{1, token, lease}` on a grant, where `token` is the token key's value (the last write or mutex
/// grant's; 0 if none), `{0, 0, pttl}` while a writer holds, [`KIND_CONFLICT`] for a mutex's hash or
/// a semaphore's counter.
///
/// Redisson's `RedissonReadLock.tryLockInnerAsync`: no `mode` → `mode=read`, the owner's field 1, its
/// timeout key `:1` with the lease, the hash's `PEXPIRE`; `mode == read`, or `write` held by this same
/// owner (Redisson's read under its own write) → one more hold, and the hash kept for
/// `max(pttl, lease)`; else the pttl. distlock keeps the hold count at 1 (reentrancy is counted in the
/// process): a field already this owner's is a resend after a lost reply, whose timeout keys are set
/// again, not a second hold. A hash without `mode` is a mutex (`RLock`), never free.
///
/// Cluster: the timeout prefix is an argument (Redisson declares it as a key, but no key has that
/// name), the timeout keys are checked with [`ELSEWHERE`]; the token key is declared, so a read
/// acquire never runs where the hash is and the counter is not (it would read no token). In a
/// migrating slot a new read hold therefore waits (`TRYAGAIN`) for the hand-over, as a mutex's acquire
/// of a free lock does.
pub const READ_ACQUIRE: &str = concat!(
    elsewhere_lua!(),
    r"
local t = redis.call('type', KEYS[1]).ok;
if t == 'string' and tonumber(redis.call('get', KEYS[1])) ~= nil then
    return {-1, 3, 0};
end;
local mode = redis.call('hget', KEYS[1], 'mode');
if mode == false then
    if t == 'hash' then
        return {-1, 1, 0};
    end;
    local moved = elsewhere({ARGV[4] .. ':1'});
    if moved then
        return moved;
    end;
    redis.call('hset', KEYS[1], 'mode', 'read', ARGV[2], 1);
    redis.call('set', ARGV[4] .. ':1', 1, 'px', ARGV[1]);
    redis.call('pexpire', KEYS[1], ARGV[1]);
    return {1, tonumber(redis.call('get', KEYS[2])) or 0, tonumber(ARGV[1])};
end;
if (mode == 'read') or (mode == 'write' and redis.call('hexists', KEYS[1], ARGV[3]) == 1) then
    local count = tonumber(redis.call('hget', KEYS[1], ARGV[2]));
    local keys = {};
    for i = count or 1, 1, -1 do
        keys[#keys + 1] = ARGV[4] .. ':' .. i;
    end;
    local moved = elsewhere(keys);
    if moved then
        return moved;
    end;
    if count == nil then
        count = redis.call('hincrby', KEYS[1], ARGV[2], 1);
        redis.call('set', ARGV[4] .. ':' .. count, 1, 'px', ARGV[1]);
    else
        for i = count, 1, -1 do
            redis.call('set', ARGV[4] .. ':' .. i, 1, 'px', ARGV[1]);
        end;
    end;
    local remain = redis.call('pttl', KEYS[1]);
    redis.call('pexpire', KEYS[1], math.max(remain, tonumber(ARGV[1])));
    return {1, tonumber(redis.call('get', KEYS[2])) or 0, tonumber(ARGV[1])};
end;
return {0, 0, redis.call('pttl', KEYS[1])};
"
);

/// Write acquire. `KEYS[1]` the lock, `KEYS[2]` the token key; `ARGV[1]` the lease in ms, `ARGV[2]` the
/// owner's write field. `{1, token, lease}` on a grant (`INCR` of the token key, first, as the mutex's),
/// `{0, 0, pttl}` while anyone else holds (readers included: no upgrade), [`KIND_CONFLICT`] for a
/// mutex's hash or a semaphore's counter.
///
/// Redisson's `RedissonWriteLock.tryLockInnerAsync`: no `mode` → `mode=write`, the field 1, `PEXPIRE`;
/// `mode == write` with this field → a resend after a lost reply (distlock keeps the count at 1): the
/// hold refreshed and a new token minted, as the mutex's; else the pttl.
pub const WRITE_ACQUIRE: &str = r"
local t = redis.call('type', KEYS[1]).ok;
if t == 'string' and tonumber(redis.call('get', KEYS[1])) ~= nil then
    return {-1, 3, 0};
end;
local mode = redis.call('hget', KEYS[1], 'mode');
if mode == false then
    if t == 'hash' then
        return {-1, 1, 0};
    end;
    local token = redis.call('incr', KEYS[2]);
    redis.call('hset', KEYS[1], 'mode', 'write', ARGV[2], 1);
    redis.call('pexpire', KEYS[1], ARGV[1]);
    return {1, token, tonumber(ARGV[1])};
end;
if mode == 'write' and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    local token = redis.call('incr', KEYS[2]);
    redis.call('pexpire', KEYS[1], ARGV[1]);
    return {1, token, tonumber(ARGV[1])};
end;
return {0, 0, redis.call('pttl', KEYS[1])};
";

/// Read release (also the undo of an abandoned read acquire). `KEYS[1]` the lock; `ARGV[1]` the owner,
/// `ARGV[2]` the publish command, `ARGV[3]` the message ([`UNLOCK_MESSAGE`]), `ARGV[4]` the channel,
/// `ARGV[5]` this owner's timeout prefix, `ARGV[6]` [`suffix_base`] (every reader's timeout keys start
/// with it). 1 if this owner's read hold was there, else 0.
///
/// Redisson's `RedissonReadLock.unlockInnerAsync` without its unlock latch: the owner's field goes
/// (all its holds: distlock's is one, but the same field of a Redisson reader may count more) with
/// its timeout keys; if other fields remain, every other reader's timeout keys are read (Redisson
/// readers may hold several each) and the hash kept for the longest of them; if none is alive (readers
/// that crashed, their keys expired) the hash goes, as when this was the last reader: `DEL` and
/// publish. Under `mode == write` (a Redisson writer's own reads) the writer keeps it. A write field
/// has no timeout keys (Redisson reads `…:<owner>:write:rwlock_timeout:1`, never there: −2).
///
/// Cluster: the channel, the prefix and the base are arguments (Redisson declares them as keys; no
/// key has those names); every timeout key it reads or deletes is looked up first, and found all on
/// this node ([`ELSEWHERE`]), before anything is written: during a slot migration a reader whose
/// key has not moved with the hash is never taken for expired.
pub const READ_RELEASE: &str = concat!(
    elsewhere_lua!(),
    r"
local mode = redis.pcall('hget', KEYS[1], 'mode');
if type(mode) ~= 'string' then
    return 0;
end;
local count = tonumber(redis.call('hget', KEYS[1], ARGV[1]));
if count == nil then
    return 0;
end;
local keys = {};
for i = count, 1, -1 do
    keys[#keys + 1] = ARGV[5] .. ':' .. i;
end;
local others = {};
for _, field in ipairs(redis.call('hkeys', KEYS[1])) do
    if field ~= ARGV[1] and string.sub(field, -6) ~= ':write' then
        local counter = tonumber(redis.call('hget', KEYS[1], field));
        if counter ~= nil then
            for i = counter, 1, -1 do
                local key = ARGV[6] .. ':' .. field .. ':rwlock_timeout:' .. i;
                keys[#keys + 1] = key;
                others[#others + 1] = key;
            end;
        end;
    end;
end;
local moved = elsewhere(keys);
if moved then
    return moved;
end;
redis.call('hdel', KEYS[1], ARGV[1]);
for i = count, 1, -1 do
    redis.call('del', ARGV[5] .. ':' .. i);
end;
if redis.call('hlen', KEYS[1]) > 1 then
    local maxRemainTime = -3;
    for _, key in ipairs(others) do
        maxRemainTime = math.max(redis.call('pttl', key), maxRemainTime);
    end;
    if maxRemainTime > 0 then
        redis.call('pexpire', KEYS[1], maxRemainTime);
        return 1;
    end;
    if mode == 'write' then
        return 1;
    end;
end;
redis.call('del', KEYS[1]);
redis.call(ARGV[2], ARGV[4], ARGV[3]);
return 1;
"
);

/// Write release (also the undo of an abandoned write acquire). `KEYS[1]` the lock; `ARGV[1]` the
/// owner's write field, `ARGV[2]` the publish command, `ARGV[3]` the message
/// ([`READ_UNLOCK_MESSAGE`]), `ARGV[4]` the channel (an argument: see [`RELEASE`]). 1 if this owner
/// held the write lock, else 0.
///
/// Redisson's `RedissonWriteLock.unlockInnerAsync` without its latch, the whole field at once (count
/// 1): the hash goes if nothing else is in it, else (a Redisson writer's own read holds) it turns to
/// `mode=read`. distlock publishes in both cases; Redisson publishes nothing on the second, and its
/// waiters then wake at their pttl.
pub const WRITE_RELEASE: &str = r"
if redis.pcall('hget', KEYS[1], 'mode') ~= 'write' then
    return 0;
end;
if redis.call('hdel', KEYS[1], ARGV[1]) == 0 then
    return 0;
end;
if redis.call('hlen', KEYS[1]) == 1 then
    redis.call('del', KEYS[1]);
else
    redis.call('hset', KEYS[1], 'mode', 'read');
end;
redis.call(ARGV[2], ARGV[4], ARGV[3]);
return 1;
";

/// Downgrade: this owner's write hold becomes its read hold in one step. `KEYS[1]` the lock; `ARGV[1]`
/// the read lease in ms, `ARGV[2]` the owner, `ARGV[3]` its write field, `ARGV[4]` the publish command,
/// `ARGV[5]` the message ([`READ_UNLOCK_MESSAGE`]: other readers may come in), `ARGV[6]` the channel,
/// `ARGV[7]` its timeout prefix. `{1, 0, lease}` done (the token is the write grant's, which the caller
/// keeps), `{0, 0, 0}` when this owner's write hold is gone.
///
/// Redisson's own downgrade in one script: the writer's read acquire (allowed under its own write: a
/// field and its timeout key `:1`), then its write release (the write field goes, `mode=read`). A
/// resend after a lost reply finds it done (`mode=read`, this owner's read field and no write field;
/// nobody else uses the owner's fields) and answers the same. The timeout key is checked with
/// [`ELSEWHERE`] (in a migrating slot the downgrade waits for the hand-over, a new key's).
pub const DOWNGRADE: &str = concat!(
    elsewhere_lua!(),
    r"
local mode = redis.pcall('hget', KEYS[1], 'mode');
if mode == 'read' and redis.call('hexists', KEYS[1], ARGV[3]) == 0
        and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    local moved = elsewhere({ARGV[7] .. ':1'});
    if moved then
        return moved;
    end;
    redis.call('set', ARGV[7] .. ':1', 1, 'px', ARGV[1]);
    redis.call('pexpire', KEYS[1], math.max(redis.call('pttl', KEYS[1]), tonumber(ARGV[1])));
    return {1, 0, tonumber(ARGV[1])};
end;
if mode ~= 'write' or redis.call('hexists', KEYS[1], ARGV[3]) == 0 then
    return {0, 0, 0};
end;
local count = (tonumber(redis.call('hget', KEYS[1], ARGV[2])) or 0) + 1;
local moved = elsewhere({ARGV[7] .. ':' .. count});
if moved then
    return moved;
end;
redis.call('hincrby', KEYS[1], ARGV[2], 1);
redis.call('set', ARGV[7] .. ':' .. count, 1, 'px', ARGV[1]);
redis.call('hdel', KEYS[1], ARGV[3]);
redis.call('hset', KEYS[1], 'mode', 'read');
local remain = redis.call('pttl', KEYS[1]);
redis.call('pexpire', KEYS[1], math.max(remain, tonumber(ARGV[1])));
redis.call(ARGV[4], ARGV[6], ARGV[5]);
return {1, 0, tonumber(ARGV[1])};
"
);

/// Read renew. `KEYS[1]` the lock; `ARGV[1]` the ttl in ms, `ARGV[2]` the owner, `ARGV[3]` its timeout
/// prefix. 1 = extended; 0 = no read hold of this owner's; −1 = no key; −2 = another type; −3 = the
/// hold's timeout key expired (the hold no longer counts: a reader's release may already have deleted
/// the hash under it, or will).
///
/// Redisson's `ReadLockTask` for one owner: every timeout key of its field `PEXPIRE`d, then the hash,
/// here for `max(pttl, ttl)` so that a reader with a short lease never cuts the hash under one with a
/// longer lease (Redisson's clients all renew to one watchdog lease; distlock's leases vary). The
/// timeout keys are checked with [`ELSEWHERE`] first: one not moved with the hash yet is not −3.
pub const READ_RENEW: &str = concat!(
    elsewhere_lua!(),
    r"
local t = redis.call('type', KEYS[1]).ok;
if t == 'none' then
    return -1;
end;
if t ~= 'hash' then
    return -2;
end;
local count = tonumber(redis.call('hget', KEYS[1], ARGV[2]));
if count == nil then
    return 0;
end;
local keys = {};
for i = count, 1, -1 do
    keys[#keys + 1] = ARGV[3] .. ':' .. i;
end;
local moved = elsewhere(keys);
if moved then
    return moved;
end;
for i = count, 1, -1 do
    if redis.call('pexpire', ARGV[3] .. ':' .. i, ARGV[1]) == 0 then
        return -3;
    end;
end;
local remain = redis.call('pttl', KEYS[1]);
redis.call('pexpire', KEYS[1], math.max(remain, tonumber(ARGV[1])));
return 1;
"
);

// ---------------------------------------------------------------------------------------------
// Semaphore: Redisson's `RPermitExpirableSemaphore` (RedissonPermitExpirableSemaphore.java).

/// Prefix of the semaphore's channel.
pub const SEMAPHORE_CHANNEL_PREFIX: &str = "redisson_sc";

/// Redisson's `nonExpirableTimeout`: the score of a permit taken without a lease. Such a permit is
/// never reclaimed; a waiter behind it wakes on a release message (and tries again every 5 s).
pub const NON_EXPIRABLE: i64 = 922_337_203_685_477;

/// The semaphore's channel: `redisson_sc:{NAME}`.
pub fn semaphore_channel(name: &str) -> String {
    prefix_name(SEMAPHORE_CHANNEL_PREFIX, name)
}

/// The semaphore's permits: the sorted set `{NAME}:timeout`, member = a permit id's 16 raw bytes,
/// score = its expiry in epoch ms.
pub fn semaphore_timeout_key(name: &str) -> String {
    suffix_name(name, "timeout")
}

/// A permit's id: 16 bytes, the first 16 of SHA-1 of the owner id (each permit of distlock's has an
/// owner of its own, so ids are distinct; being derived, an undo, a release or a renewal needs only the
/// owner). Redisson's ids are 16 random bytes; the sorted set holds both kinds alike.
pub fn permit_id(owner: &str) -> [u8; 16] {
    use sha1::{Digest, Sha1};
    let digest = Sha1::digest(owner.as_bytes());
    let mut id = [0u8; 16];
    id.copy_from_slice(&digest[..16]);
    id
}

/// A permit id as Redisson hands it out (`ByteBufUtil.hexDump`): 32 lowercase hex digits. What
/// `LockGuard::permit()` and `DISTLOCK_PERMIT` show, and what Redisson's `release(permitId)` takes.
///
/// ```
/// use distlock_redis::layout::{permit_hex, permit_id};
/// assert_eq!(permit_hex(&permit_id("abc")), "a9993e364706816aba3e25717850c26c");
/// ```
pub fn permit_hex(id: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut hex = String::with_capacity(id.len() * 2);
    for byte in id {
        // Writing into a String cannot fail.
        let _ = write!(hex, "{byte:02x}");
    }
    hex
}

/// Permit acquire. `KEYS[1]` the counter (`NAME`), `KEYS[2]` the permits ([`semaphore_timeout_key`]),
/// `KEYS[3]` the token key; `ARGV[1]` the limit, `ARGV[2]` the lease in ms, `ARGV[3]` the permit id
/// (raw), `ARGV[4]` the publish command, `ARGV[5]` the channel (an argument: see [`RELEASE`]).
/// `{1, token, lease} on a grant (a new
/// token each), `{0, 0, ms}` when every permit is taken (`ms` until the earliest expiry, −1 when none
/// expires), `{LIMIT_MISMATCH, stored, 0}`, or [`KIND_CONFLICT`] for a mutex's or read-write lock's
/// hash.
///
/// Redisson's `tryAcquireAsync`, with the server's clock (`TIME`) for its `now` and every expiry:
/// expired permits are reclaimed first (removed, the counter `INCRBY` their number, the new count
/// published, as Redisson does); a counter that does not exist is set as `trySetPermits` does (`SET`
/// of the limit, less permits somehow still in the set, so the bound holds even then); the stored
/// limit is the counter plus the permits in the set (what Redisson's `getPermits` answers), and
/// another limit is refused. Then `DECRBY 1` and `ZADD` of the id with `now + lease`, and the set
/// given the counter's TTL if it has one (Redisson's). An id already in the set is a resend after a
/// lost reply: its expiry is refreshed and a new token minted, no second permit taken. Not an
/// integer at `NAME`: `WRONGTYPE`.
///
/// Cluster: it touches only its three keys, all declared, so in a migrating slot it runs where all
/// three are, and is refused (`TRYAGAIN`) while they are split, or while one of them does not exist
/// yet (the permits' set of a semaphore nobody holds: a new permit waits for the hand-over, as a
/// mutex's acquire of a free lock does). Never on a node without the token counter.
pub const PERMIT_ACQUIRE: &str = r"
local t = redis.call('type', KEYS[1]).ok;
if t == 'hash' then
    if redis.call('hexists', KEYS[1], 'mode') == 1 then
        return {-1, 2, 0};
    end;
    return {-1, 1, 0};
end;
local value = redis.call('get', KEYS[1]);
if value ~= false and tonumber(value) == nil then
    return redis.error_reply('WRONGTYPE the key holds a string that is not a permit counter');
end;
local time = redis.call('time');
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000);
local expired = redis.call('zrangebyscore', KEYS[2], 0, now);
for i = 1, #expired, 1000 do
    redis.call('zrem', KEYS[2], unpack(expired, i, math.min(i + 999, #expired)));
end;
local limit = tonumber(ARGV[1]);
local available;
if value == false then
    available = math.max(limit - redis.call('zcard', KEYS[2]), 0);
    redis.call('set', KEYS[1], available);
else
    available = tonumber(value);
    if #expired > 0 then
        available = redis.call('incrby', KEYS[1], #expired);
        if available > 0 then
            redis.call(ARGV[4], ARGV[5], available);
        end;
    end;
end;
local stored = available + redis.call('zcard', KEYS[2]);
if stored ~= limit then
    return {-2, stored, 0};
end;
if redis.call('zscore', KEYS[2], ARGV[3]) ~= false then
    local token = redis.call('incr', KEYS[3]);
    redis.call('zadd', KEYS[2], now + tonumber(ARGV[2]), ARGV[3]);
    return {1, token, tonumber(ARGV[2])};
end;
if available >= 1 then
    local token = redis.call('incr', KEYS[3]);
    redis.call('decrby', KEYS[1], 1);
    redis.call('zadd', KEYS[2], now + tonumber(ARGV[2]), ARGV[3]);
    local ttl = redis.call('pttl', KEYS[1]);
    if ttl > 0 then
        redis.call('pexpire', KEYS[2], ttl);
    end;
    return {1, token, tonumber(ARGV[2])};
end;
local first = redis.call('zrange', KEYS[2], 0, 0, 'WITHSCORES');
if first[2] ~= nil and tonumber(first[2]) < 922337203685477 then
    return {0, 0, math.max(tonumber(first[2]) - now, 0)};
end;
return {0, 0, -1};
";

/// Permit release (also the undo of an abandoned permit acquire). `KEYS[1]` the counter, `KEYS[2]` the
/// permits; `ARGV[1]` the permit id, `ARGV[2]` the publish command, `ARGV[3]` the channel (an
/// argument: see [`RELEASE`]). 1 if the permit was in the set (removed, the counter `INCRBY 1`, the new
/// count published: Redisson's `tryReleaseAsync`), else 0 (released already, or reclaimed after it
/// expired). A permit whose expiry passed but that nobody reclaimed was still this owner's (only a
/// reclaim frees it): 1. Cluster: both keys declared, so in a migrating slot it runs on the node that
/// has both (after an `ASK`, on the target) and is refused (`TRYAGAIN`) while they are split.
pub const PERMIT_RELEASE: &str = r"
if redis.pcall('zrem', KEYS[2], ARGV[1]) ~= 1 then
    return 0;
end;
local value = redis.call('incrby', KEYS[1], 1);
redis.call(ARGV[2], ARGV[3], value);
return 1;
";

/// Permit renew (Redisson's `updateLeaseTime`, on the server's clock). `KEYS[1]` the permits; `ARGV[1]`
/// the ttl in ms, `ARGV[2]` the permit id. 1 = extended (`ZADD XX now + ttl`); 0 = not in the set (or no
/// set: removing its last member deletes it); −2 = another type; −3 = its expiry has passed (anyone's
/// next acquire may reclaim it).
pub const PERMIT_RENEW: &str = r"
local t = redis.call('type', KEYS[1]).ok;
if t == 'none' then
    return 0;
end;
if t ~= 'zset' then
    return -2;
end;
local score = redis.call('zscore', KEYS[1], ARGV[2]);
if score == false then
    return 0;
end;
local time = redis.call('time');
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000);
if tonumber(score) <= now then
    return -3;
end;
redis.call('zadd', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[2]);
return 1;
";

/// Inspect, read-only. `KEYS[1]` the name's key, `KEYS[2]` the token key, `KEYS[3]` the permits;
/// `ARGV[1]` [`suffix_base`]. Returns `{kind, token, limit, holder, ms, holder, ms, …}`: `kind` is
/// `none`, `mutex` (a Redisson hash, or a plain layout's string: its value is the holder), `write`,
/// `read`, `permit` (a string of digits without expiry, or beside its permits' set: a semaphore's
/// counter) or the key's type; `token` the token key's value (`''`
/// if none); `limit` a semaphore's (else 0); then each holder (the owner; a permit's raw id) with its
/// remaining ms (a reader's: its longest timeout key; a permit's: expiry − `TIME`, −1 without
/// expiry; negative when expired and not yet removed).
///
/// Cluster: in a migrating slot Redis runs it only where its three keys all are (a mutex has no
/// permits' set: never), and the readers' timeout keys are checked with [`ELSEWHERE`]; otherwise
/// `TRYAGAIN` or `ASK`, and the client reads each key where it is instead, one request per key.
pub const INSPECT: &str = concat!(
    elsewhere_lua!(),
    r"
local t = redis.call('type', KEYS[1]).ok;
local out = {t, redis.call('get', KEYS[2]) or '', 0};
if t == 'hash' then
    local mode = redis.call('hget', KEYS[1], 'mode');
    local pttl = redis.call('pttl', KEYS[1]);
    out[1] = mode or 'mutex';
    local readers, keys = {}, {};
    for _, field in ipairs(redis.call('hkeys', KEYS[1])) do
        local writer = string.sub(field, -6) == ':write';
        if field == 'mode' then
        elseif mode == false then
            table.insert(out, field);
            table.insert(out, pttl);
        elseif mode == 'write' and writer then
            table.insert(out, string.sub(field, 1, -7));
            table.insert(out, pttl);
        elseif mode == 'read' and not writer then
            local own = {};
            for i = tonumber(redis.call('hget', KEYS[1], field)) or 0, 1, -1 do
                local key = ARGV[1] .. ':' .. field .. ':rwlock_timeout:' .. i;
                table.insert(own, key);
                table.insert(keys, key);
            end;
            table.insert(readers, {field, own});
        end;
    end;
    local moved = elsewhere(keys);
    if moved then
        return moved;
    end;
    for _, reader in ipairs(readers) do
        local remain = -2;
        for _, key in ipairs(reader[2]) do
            remain = math.max(remain, redis.call('pttl', key));
        end;
        table.insert(out, reader[1]);
        table.insert(out, remain);
    end;
elseif t == 'string' then
    local value = redis.call('get', KEYS[1]);
    local pttl = redis.call('pttl', KEYS[1]);
    local available = nil;
    if string.match(value, '^%d+$') and (pttl == -1 or redis.call('exists', KEYS[3]) == 1) then
        available = tonumber(value);
    end;
    if available == nil then
        out[1] = 'mutex';
        table.insert(out, value);
        table.insert(out, pttl);
    else
        local time = redis.call('time');
        local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000);
        local held = redis.call('zrange', KEYS[3], 0, -1, 'WITHSCORES');
        out[1] = 'permit';
        out[3] = available + #held / 2;
        for i = 1, #held, 2 do
            local score = tonumber(held[i + 1]);
            table.insert(out, held[i]);
            if score >= 922337203685477 then
                table.insert(out, -1);
            else
                table.insert(out, score - now);
            end;
        end;
    end;
end;
return out;
"
);

/// What [`BREAK`] answers when the holder given is a reader of the name (its owner id has a read
/// field there, and no hold id was given): break ends an exclusive holder only.
pub const BREAK_READERS: i64 = -1;

/// What [`BREAK`] answers when the holder given holds a permit of the name (a semaphore's permit
/// whose id is its owner's, see [`permit_id`], and no hold id was given).
pub const BREAK_PERMITS: i64 = -2;

/// Break (`distlock break`, `Locks::break_holder`): an operator ends another holder's exclusive hold,
/// the one `inspect` showed, if that hold still holds the name. `KEYS[1]` the lock, `KEYS[2]`
/// [`queue_key`], `KEYS[3]` [`queue_timeout_key`], `KEYS[4]` [`semaphore_timeout_key`], and
/// `KEYS[5]` [`token_key`] only when a hold id is given; `ARGV[1]` the owner, `ARGV[2]` its write
/// field ([`write_field`]), `ARGV[3]` the publish command, `ARGV[4]` [`UNLOCK_MESSAGE`], `ARGV[5]`
/// [`READ_UNLOCK_MESSAGE`], `ARGV[6]` the release channel ([`channel`]), `ARGV[7]` the plain
/// layout's ([`plain_channel`]), `ARGV[8]` [`rw_channel`], `ARGV[9]` [`waiter_channel_prefix`]
/// (channels are arguments: see [`RELEASE`]), `ARGV[10]` the owner's [`permit_id`] (raw), `ARGV[11]`
/// the hold id (with `KEYS[5]`). Answers 1 when the hold was ended, 0 when that hold no longer
/// holds the name (nothing written), [`BREAK_READERS`] or [`BREAK_PERMITS`] when the holder given
/// is itself a reader or a permit's holder there (nothing written).
///
/// **The hold id** (`HolderInfo::hold_id`) is the token counter's value that [`INSPECT`] read in
/// the same script as the holder: every grant that mints a token (a mutex's and a writer's in
/// Redisson's layout, a plain one's with tokens on, a permit's; a fair one's and a handoff's too)
/// `INCR`s the counter, so a counter that moved since means a grant came since, and the break
/// answers 0 before it looks at anything else: a `Lock` that released and acquired again (same owner
/// id) is never broken by a break aimed at its earlier hold. A holder that mints no token (Redisson's
/// `RLock` and `RReadWriteLock`, a plain lock with `tokens=false`, redis-py) leaves the counter as it
/// is, so a later hold of *the same owner id* still matches: for those the owner is all that is
/// compared (a Redisson owner is `<client id>:<thread id>`, shared by every hold on one pooled
/// thread). Without a hold id (a holder built by hand, a counter that did not exist) the owner alone
/// is compared.
///
/// What the name is, is read from the server as [`INSPECT`] reads it, whatever the caller's own
/// layout or mode (an operator's URL need not match the holders'):
///
/// * a hash without `mode` (a mutex, Redisson's layout) with the owner's field: the whole key is
///   deleted, whatever the hold count (a Redisson holder re-entered several times is broken too);
///   `0` is published on the release channel;
/// * a hash with `mode=write` and the owner's write field: the whole hash goes (a Redisson writer's
///   own read holds under its write go with it; their timeout keys expire by themselves, nothing
///   reads them without the field), and `1` is published on the read-write channel, as a write
///   release does; with `mode=read`: [`BREAK_READERS`] if the owner given is one of the readers and
///   no hold id was given (a reader is not an exclusive holder), else 0 (the writer shown is gone);
/// * a string: a semaphore's counter by [`INSPECT`]'s rule (digits, and no expiry or permits
///   beside it) is [`BREAK_PERMITS`] if the owner's permit is held and no hold id was given, else 0
///   (the holder shown is gone); any other string is a plain layout's lock, deleted if its value is
///   the owner, and `0` published on the plain channel.
///
/// After a mutex's hold is broken, a fair queue beside it (if any: nothing of it is touched
/// otherwise, so a user without fair mode's ACL rules can break a lock nobody queues for) is mended
/// as every fair script mends it (waiters past their deadline dropped) and its head woken on its
/// own channel, as a fair release does. Every publish runs before the `DEL`: a publish the ACL
/// refuses fails the script before it deleted anything. The token counter is only read, never
/// written (tokens keep rising), and no renewal recreates the key: every renew script extends only a
/// key that holds its owner, so the broken holder's next renewal finds it gone and its guard goes
/// `Lost`.
///
/// Cluster: every key is declared, and all are in the name's slot ([`keys_share_slot`], the token
/// counter included); in a slot under migration the script runs where all of them are, so while
/// the queue or the permits' set does not exist (most of the time) it is refused with `TRYAGAIN`
/// until the migration ends, as a fair release is.
///
/// ```
/// use distlock_redis::layout;
/// // The break deletes the lock's key and nothing else: the token counter is never written.
/// assert!(!layout::BREAK.contains("incr"));
/// let deletes = layout::BREAK.matches("'del'").count();
/// assert_eq!(layout::BREAK.matches("'del', KEYS[1])").count(), deletes);
/// // A hold id is compared with the counter before anything else.
/// let compared = layout::BREAK.find("~= ARGV[11]").unwrap();
/// assert!(compared < layout::BREAK.find("'type', KEYS[1]").unwrap());
/// ```
pub const BREAK: &str = concat!(
    r"
local function wake_fair_head()
    if redis.call('exists', KEYS[2]) == 0 then
        return;
    end;
    local queue, deadlines = KEYS[2], KEYS[3];
",
    fair_prelude_lua!(),
    r"
    local head = redis.call('lindex', queue, 0);
    if head then
        redis.call(ARGV[3], ARGV[9] .. head, ARGV[4]);
    end;
end;
local shown = #KEYS >= 5;
if shown and redis.pcall('get', KEYS[5]) ~= ARGV[11] then
    return 0;
end;
local t = redis.call('type', KEYS[1]).ok;
if t == 'hash' then
    local mode = redis.call('hget', KEYS[1], 'mode');
    if mode == 'read' then
        if not shown and redis.call('hexists', KEYS[1], ARGV[1]) == 1 then
            return -1;
        end;
        return 0;
    end;
    if mode == 'write' then
        if redis.call('hexists', KEYS[1], ARGV[2]) == 0 then
            return 0;
        end;
        redis.call(ARGV[3], ARGV[8], ARGV[5]);
        redis.call('del', KEYS[1]);
        return 1;
    end;
    if mode ~= false or redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
        return 0;
    end;
    redis.call(ARGV[3], ARGV[6], ARGV[4]);
    wake_fair_head();
    redis.call('del', KEYS[1]);
    return 1;
end;
if t == 'string' then
    local value = redis.call('get', KEYS[1]);
    if string.match(value, '^%d+$') then
        if redis.call('exists', KEYS[4]) == 1 then
            if not shown and redis.call('zscore', KEYS[4], ARGV[10]) ~= false then
                return -2;
            end;
            return 0;
        end;
        if redis.call('pttl', KEYS[1]) == -1 then
            return 0;
        end;
    end;
    if value ~= ARGV[1] then
        return 0;
    end;
    redis.call(ARGV[3], ARGV[7], ARGV[4]);
    wake_fair_head();
    redis.call('del', KEYS[1]);
    return 1;
end;
return 0;
"
);

/// The scripts, compiled once (redis-rs sends `EVALSHA` and falls back to `EVAL` on `NOSCRIPT`).
#[derive(Debug)]
pub(crate) struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) release: Script,
    pub(crate) renew: Script,
    pub(crate) hand_off: Script,
    pub(crate) read_acquire: Script,
    pub(crate) write_acquire: Script,
    pub(crate) read_release: Script,
    pub(crate) write_release: Script,
    pub(crate) downgrade: Script,
    pub(crate) read_renew: Script,
    pub(crate) permit_acquire: Script,
    pub(crate) permit_release: Script,
    pub(crate) permit_renew: Script,
    pub(crate) inspect: Script,
    pub(crate) plain_acquire: Script,
    pub(crate) plain_release: Script,
    pub(crate) plain_renew: Script,
    pub(crate) plain_hand_off: Script,
    pub(crate) fair_acquire: Script,
    pub(crate) fair_plain_acquire: Script,
    pub(crate) fair_release: Script,
    pub(crate) fair_plain_release: Script,
    pub(crate) break_holder: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Self {
            acquire: Script::new(ACQUIRE),
            release: Script::new(RELEASE),
            renew: Script::new(RENEW),
            hand_off: Script::new(HAND_OFF),
            read_acquire: Script::new(READ_ACQUIRE),
            write_acquire: Script::new(WRITE_ACQUIRE),
            read_release: Script::new(READ_RELEASE),
            write_release: Script::new(WRITE_RELEASE),
            downgrade: Script::new(DOWNGRADE),
            read_renew: Script::new(READ_RENEW),
            permit_acquire: Script::new(PERMIT_ACQUIRE),
            permit_release: Script::new(PERMIT_RELEASE),
            permit_renew: Script::new(PERMIT_RENEW),
            inspect: Script::new(INSPECT),
            plain_acquire: Script::new(PLAIN_ACQUIRE),
            plain_release: Script::new(PLAIN_RELEASE),
            plain_renew: Script::new(PLAIN_RENEW),
            plain_hand_off: Script::new(PLAIN_HAND_OFF),
            fair_acquire: Script::new(FAIR_ACQUIRE),
            fair_plain_acquire: Script::new(FAIR_PLAIN_ACQUIRE),
            fair_release: Script::new(FAIR_RELEASE),
            fair_plain_release: Script::new(FAIR_PLAIN_RELEASE),
            break_holder: Script::new(BREAK),
        }
    }

    /// Every script, to load them all (after a `NOSCRIPT`).
    pub(crate) fn all(&self) -> [&Script; 23] {
        [
            &self.acquire,
            &self.release,
            &self.renew,
            &self.hand_off,
            &self.read_acquire,
            &self.write_acquire,
            &self.read_release,
            &self.write_release,
            &self.downgrade,
            &self.read_renew,
            &self.permit_acquire,
            &self.permit_release,
            &self.permit_renew,
            &self.inspect,
            &self.plain_acquire,
            &self.plain_release,
            &self.plain_renew,
            &self.plain_hand_off,
            &self.fair_acquire,
            &self.fair_plain_acquire,
            &self.fair_release,
            &self.fair_plain_release,
            &self.break_holder,
        ]
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
