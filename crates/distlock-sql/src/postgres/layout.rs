//! The whole PostgreSQL layout: the advisory key of a name, the tables, and every statement distlock
//! sends.
//!
//! **Advisory key.** A name locks the 64-bit key [`advisory_key`]: the first 8 bytes of the SHA-1 of
//! its UTF-8 bytes, read little-endian as a signed integer. That is the key .NET DistributedLock's
//! `new PostgresAdvisoryLockKey(name, allowHashing: true)` computes for the names it hashes (any name
//! that is not 0–9 ASCII characters and not 16 hex digits), so the two exclude each other on such
//! names. `?key=<int>` / `?key=<int>,<int>` in the URL locks that numeric key instead (one-`bigint`
//! and two-`int` key spaces, which PostgreSQL keeps apart). In `pg_locks` the key shows as
//! `locktype = 'advisory'`, `classid` = the high 32 bits, `objid` = the low 32 bits, `objsubid = 1`
//! (`2` for the two-int form: `classid` = the first int, `objid` = the second).
//!
//! **Tables** (created on first use, `CREATE TABLE IF NOT EXISTS` under a transaction-scoped advisory
//! lock on [`SCHEMA_LOCK_KEY`], because concurrent `CREATE TABLE IF NOT EXISTS` can fail with a
//! unique violation on PostgreSQL):
//!
//! ```sql
//! CREATE TABLE <table> (          -- row and lease modes: one row per name
//!   name text COLLATE "C" PRIMARY KEY,   -- the lock name, case kept, up to 1,024 bytes
//!   owner text,                   -- lease mode: the holder's owner id, NULL when free
//!   expires_at timestamptz,       -- lease mode: the lease's end, on the database's clock
//!   version bigint NOT NULL DEFAULT 0);  -- lease mode: bumped on every grant; the fencing token
//! CREATE TABLE <table>_fence (    -- advisory and row modes: the fencing counter per name
//!   name text COLLATE "C" PRIMARY KEY,
//!   token bigint NOT NULL);
//! CREATE TABLE <table>_limit (    -- advisory mode: a semaphore's limit, stored with its first permit
//!   name text COLLATE "C" PRIMARY KEY,   -- and kept (see "Semaphore" below)
//!   permits integer NOT NULL);
//! ```
//!
//! `<table>_limit` came with the semaphore: a server that has the first two tables but not this one
//! gets it at connect when the role may create it; if it may not, everything but semaphores works
//! (a read lock's check then finds no table, which means no semaphore), and the operator creates it
//! with the statement above.
//!
//! Lease-mode releases and permit releases `NOTIFY` the channel named after the table with the lock
//! name as payload; waiters `LISTEN` on it.
//!
//! **Read-write lock** (advisory mode). The name's one key [`advisory_key`] (or `?key=`), as .NET
//! DistributedLock's `PostgresDistributedReaderWriterLock` uses it: a read lock is
//! `pg_advisory_lock_shared(key)`, a write lock is `pg_advisory_lock(key)`, the very lock the mutex
//! takes, so the mutex and the write side of a name are one lock. PostgreSQL queues a new shared
//! request behind a waiting exclusive one, so readers arriving after a waiting writer wait for it
//! (first come, first served). A write grant bumps `<table>_fence` as the mutex's does; a reader reads
//! the counter after its lock is granted (the last write grant's token, 0 if there was none). A
//! downgrade is `pg_advisory_lock_shared(key)` then `pg_advisory_unlock(key)` on the writer's session
//! (a session's own locks never conflict, and a request that conflicts only with waiters is placed
//! ahead of them when the session already holds a conflicting lock, so it is granted at once). In row
//! mode a read lock is the name's row `FOR SHARE` and a write lock the mutex's `FOR UPDATE`, in the
//! held transaction.
//!
//! **Semaphore** (advisory mode). A permit is one of `N` keys in PostgreSQL's two-int key space,
//! [`permit_key`]`(name, slot)` for `slot` in `0..N`, taken with `pg_try_advisory_lock` slot by slot
//! (the first free slot, in one statement), plus the name's key **shared**
//! (`pg_try_advisory_lock_shared(key)`). The shared hold makes the name's mutex and write lock (the
//! key exclusive) and its permits exclude each other in the server; a read lock (also shared) checks
//! `<table>_limit` once its lock is granted and is refused with `KindConflict` on a name that has a
//! stored limit. The limit is written once, under the name's key held exclusive (so no reader holds it
//! then, and every later reader sees the row), and kept: another `N` is `LimitMismatch`. To change it,
//! once no permit is held: `DELETE FROM <table>_limit WHERE name = '<name>'`. Each grant bumps the
//! name's fencing counter. The permit id is the slot number. A permit release unlocks both keys and
//! `NOTIFY`s the channel; waiters also poll (see `semaphore.rs`), since a session that ends frees its
//! slot without a notification.

use sha1::{Digest, Sha1};

use crate::config::AdvisoryKey;

/// The key of the transaction-scoped advisory lock taken around the schema creation: the
/// [`advisory_key`] of `"distlock schema"`.
pub const SCHEMA_LOCK_KEY: &str = "distlock schema";

/// The suffix of the fencing counter table's name.
pub const FENCE_SUFFIX: &str = "_fence";

/// The suffix of the semaphore limit table's name: with the default table, an operator changes a
/// semaphore's limit (once no permit is held) by deleting its row there.
///
/// ```
/// use distlock_sql::postgres::layout::LIMIT_SUFFIX;
/// let table = format!("{}{LIMIT_SUFFIX}", distlock_sql::DEFAULT_TABLE);
/// assert_eq!(table, "distlock_locks_limit");
/// // DELETE FROM distlock_locks_limit WHERE name = 'workers';
/// ```
pub const LIMIT_SUFFIX: &str = "_limit";

/// The advisory key of a lock name (see the [module docs](self)). The same number in Python:
/// `struct.unpack('<q', hashlib.sha1(name.encode()).digest()[:8])[0]`.
///
/// ```
/// use distlock_sql::postgres::layout::advisory_key;
/// assert_eq!(advisory_key("orders/42"), 5_352_588_492_203_550_839);
/// assert_eq!(advisory_key("Orders/42"), -7_389_573_467_798_880_305);
/// assert_ne!(advisory_key("a"), advisory_key("A"));
/// ```
pub fn advisory_key(name: &str) -> i64 {
    let digest = Sha1::digest(name.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_le_bytes(first)
}

/// The key of permit `slot` of `name`'s semaphore, in PostgreSQL's two-int key space (`objsubid = 2`
/// in `pg_locks`), which never meets the one-`bigint` space of [`advisory_key`]: the first int is
/// bytes 0..4 of the SHA-1 of the name (little-endian), the second is bytes 4..6 (little-endian) in
/// its high 16 bits and the slot in its low 16 bits (a semaphore has at most 65,536 permits). So two
/// names share slot keys only if 48 bits of their hashes agree, and even then no semaphore ever has
/// more holders than its limit (a slot taken by the other name is merely busy). In `pg_locks`:
/// `classid` = the first int, `objid` = the second, so `objid & 65535` is the slot.
///
/// ```
/// use distlock_sql::AdvisoryKey;
/// use distlock_sql::postgres::layout::{advisory_key, permit_key, pg_locks_row};
/// assert_eq!(permit_key("workers", 0), AdvisoryKey::Pair(50_941_687, 505_020_416));
/// assert_eq!(permit_key("workers", 3), AdvisoryKey::Pair(50_941_687, 505_020_419));
/// assert_eq!(pg_locks_row(permit_key("workers", 65_535)), (0x0309_4ef7, 0x1e1a_ffff, 2));
/// // A permit key is never a name's (mutex, read-write) key: another key space.
/// assert_eq!(pg_locks_row(AdvisoryKey::Single(advisory_key("workers"))).2, 1);
/// ```
pub fn permit_key(name: &str, slot: u32) -> AdvisoryKey {
    let digest = Sha1::digest(name.as_bytes());
    let first = i32::from_le_bytes([digest[0], digest[1], digest[2], digest[3]]);
    let high = u32::from(u16::from_le_bytes([digest[4], digest[5]]));
    // Bit for bit: the second int's high half is the hash, the low half the slot.
    let second = ((high << 16) | (slot & 0xffff)) as i32;
    AdvisoryKey::Pair(first, second)
}

/// What a name locks in advisory mode: the URL's numeric key if one was given, else the name's hash.
pub(crate) fn key_for(name: &str, configured: Option<AdvisoryKey>) -> AdvisoryKey {
    configured.unwrap_or_else(|| AdvisoryKey::Single(advisory_key(name)))
}

/// How a key shows in `pg_locks`: `(classid, objid, objsubid)`.
///
/// ```
/// use distlock_sql::AdvisoryKey;
/// use distlock_sql::postgres::layout::pg_locks_row;
/// assert_eq!(pg_locks_row(AdvisoryKey::Single(-2)), (0xffff_ffff, 0xffff_fffe, 1));
/// assert_eq!(pg_locks_row(AdvisoryKey::Pair(7, -1)), (7, 0xffff_ffff, 2));
/// ```
pub fn pg_locks_row(key: AdvisoryKey) -> (u32, u32, i16) {
    match key {
        AdvisoryKey::Pair(a, b) => (a as u32, b as u32, 2),
        // `AdvisoryKey` is non_exhaustive only towards other crates.
        AdvisoryKey::Single(k) => ((k >> 32) as u32, k as u32, 1),
    }
}

/// A quoted, schema-qualified table name. Identifiers are checked by `SqlConfig::validate` (letters,
/// digits, `_`), so quoting needs no escaping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tables {
    /// `"schema"."table"` or `"table"`.
    pub(crate) locks: String,
    /// The fencing counter table.
    pub(crate) fence: String,
    /// The semaphore limit table.
    pub(crate) limit: String,
    /// The NOTIFY channel (the table name).
    pub(crate) channel: String,
}

impl Tables {
    pub(crate) fn new(schema: Option<&str>, table: &str) -> Self {
        let qualify = |t: &str| match schema {
            Some(s) => format!("\"{s}\".\"{t}\""),
            None => format!("\"{t}\""),
        };
        Self {
            locks: qualify(table),
            fence: qualify(&format!("{table}{FENCE_SUFFIX}")),
            limit: qualify(&format!("{table}{LIMIT_SUFFIX}")),
            channel: table.to_string(),
        }
    }

    /// The schema creation, one simple-query batch in one transaction.
    pub(crate) fn create(&self) -> String {
        let key = advisory_key(SCHEMA_LOCK_KEY);
        format!(
            "BEGIN; SELECT pg_advisory_xact_lock({key}); \
             CREATE TABLE IF NOT EXISTS {locks} (name text COLLATE \"C\" PRIMARY KEY, owner text, \
             expires_at timestamptz, version bigint NOT NULL DEFAULT 0); \
             CREATE TABLE IF NOT EXISTS {fence} (name text COLLATE \"C\" PRIMARY KEY, token bigint NOT NULL); \
             {limit_table}; \
             COMMIT",
            locks = self.locks,
            fence = self.fence,
            limit_table = self.create_limit_table(),
        )
    }

    /// `CREATE TABLE IF NOT EXISTS <table>_limit …`, alone.
    fn create_limit_table(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (name text COLLATE \"C\" PRIMARY KEY, permits integer NOT NULL)",
            self.limit
        )
    }

    /// The creation of the limit table alone (a server whose tables predate the semaphore), one
    /// simple-query batch in one transaction.
    pub(crate) fn create_limit(&self) -> String {
        format!(
            "BEGIN; SELECT pg_advisory_xact_lock({}); {}; COMMIT",
            advisory_key(SCHEMA_LOCK_KEY),
            self.create_limit_table()
        )
    }

    /// As [`shape_of_locks`](Self::shape_of_locks) for the limit table.
    pub(crate) fn shape_of_limit(&self) -> String {
        format!("SELECT name, permits FROM {} LIMIT 0", self.limit)
    }

    /// Reads no rows but fails if a column is missing; the column types are checked on the prepared
    /// statement.
    pub(crate) fn shape_of_locks(&self) -> String {
        format!(
            "SELECT name, owner, expires_at, version FROM {} LIMIT 0",
            self.locks
        )
    }

    /// As [`shape_of_locks`](Self::shape_of_locks) for the fence table.
    pub(crate) fn shape_of_fence(&self) -> String {
        format!("SELECT name, token FROM {} LIMIT 0", self.fence)
    }

    /// Touches both tables, so a new server session has loaded them before its first lock statement
    /// (a cold session's first access costs catalog lookups inside the acquire's validity window).
    pub(crate) fn warm_up(&self) -> String {
        format!(
            "SELECT 1 FROM {} WHERE false; SELECT 1 FROM {} WHERE false",
            self.locks, self.fence
        )
    }

    /// Bumps the fencing counter of `$1` and returns it (autocommit: committed when it returns).
    pub(crate) fn next_token(&self) -> String {
        format!(
            "INSERT INTO {fence} AS f (name, token) VALUES ($1, 1) \
             ON CONFLICT (name) DO UPDATE SET token = f.token + 1 RETURNING token",
            fence = self.fence
        )
    }

    /// Advisory mode's try: `pg_try_advisory_lock` and, only when it got the lock, the fencing counter
    /// bump of `$1`, in one autocommit statement (one round trip; the counter is committed before the
    /// answer). Returns one row: whether it got the lock, and the new token (`NULL` when busy). A
    /// session advisory lock ignores transactions, so the lock stays if the bump fails: the caller
    /// closes the connection then.
    /// The key is a parameter from `$2` (`Params::key`), so the text is one per key shape, prepared once
    /// per connection.
    pub(crate) fn try_lock_and_next_token(&self, key: AdvisoryKey) -> String {
        let lock = advisory_call_at(key, "pg_try_advisory_lock", 2);
        format!(
            "WITH l AS (SELECT {lock} AS got), \
             t AS (INSERT INTO {fence} AS f (name, token) SELECT $1, 1 FROM l WHERE l.got \
             ON CONFLICT (name) DO UPDATE SET token = f.token + 1 RETURNING token) \
             SELECT l.got, (SELECT token FROM t) FROM l",
            fence = self.fence
        )
    }

    /// The last token minted for `$1`.
    pub(crate) fn last_token(&self) -> String {
        format!("SELECT token FROM {} WHERE name = $1", self.fence)
    }

    /// A reader's token and kind check in one statement: the last token minted for `$1` and the
    /// semaphore limit stored for it, each `NULL` when there is none.
    pub(crate) fn last_token_and_limit(&self) -> String {
        format!(
            "SELECT (SELECT token FROM {} WHERE name = $1), (SELECT permits FROM {} WHERE name = $1)",
            self.fence, self.limit
        )
    }

    /// The semaphore limit stored for `$1`, if any.
    pub(crate) fn stored_limit(&self) -> String {
        format!("SELECT permits FROM {} WHERE name = $1", self.limit)
    }

    /// A permit's try, one autocommit statement: if the limit stored for `$1` is `$2`, the name's key
    /// shared (`key`), then the first free slot of `$2` (the keys [`permit_key`]`(name, s)`, whose
    /// first is `first_slot`), and, only when a slot was taken, the fencing counter bump. The key is
    /// let go again when no slot is free. Returns one row: the stored limit (`NULL`: none yet), the
    /// slot taken (`-1`: all taken, `-2`: the key is held exclusive or a writer waits for it; `NULL`
    /// when the limit differs), and the new token. `CASE` and `COALESCE` evaluate only what they need,
    /// so nothing is locked unless the limit agrees, and the slot subquery (an init plan, run on first
    /// use) stops at its first slot. The name's key is a parameter from `$3`, then the first slot's two
    /// ints (`Params::key` of both, in that order).
    pub(crate) fn try_permit(&self, key: AdvisoryKey) -> String {
        let slot_at = 3 + key_arity(key);
        let (a, b) = (slot_at, slot_at + 1);
        format!(
            "WITH g AS (SELECT lim.stored, CASE WHEN lim.stored = $2 THEN \
               CASE WHEN {shared} THEN COALESCE(\
                 (SELECT s FROM generate_series(0, $2 - 1) AS s WHERE pg_try_advisory_lock(${a}::integer, ${b}::integer + s) LIMIT 1), \
                 CASE WHEN {unshare} THEN -1 END) \
               ELSE -2 END END AS slot \
               FROM (SELECT (SELECT permits FROM {limit} WHERE name = $1) AS stored) AS lim), \
             t AS (INSERT INTO {fence} AS f (name, token) SELECT $1, 1 FROM g WHERE g.slot >= 0 \
               ON CONFLICT (name) DO UPDATE SET token = f.token + 1 RETURNING token) \
             SELECT g.stored, g.slot, (SELECT token FROM t) FROM g",
            shared = advisory_call_at(key, "pg_try_advisory_lock_shared", 3),
            unshare = advisory_call_at(key, "pg_advisory_unlock_shared", 3),
            limit = self.limit,
            fence = self.fence
        )
    }

    /// A semaphore's first permit stores its limit: the name's key exclusive (`key`; no reader or
    /// permit holds it then) and, only when it was got, the limit row of `$1` = `$2` unless one exists.
    /// Returns whether the key was got; the caller unlocks it in a statement of its own, after this
    /// one's commit, so whoever gets the key next sees the row.
    pub(crate) fn store_limit(&self, key: AdvisoryKey) -> String {
        format!(
            "WITH x AS (SELECT {lock} AS got), \
             i AS (INSERT INTO {limit} (name, permits) SELECT $1, $2 FROM x WHERE x.got \
               ON CONFLICT (name) DO NOTHING) \
             SELECT got FROM x",
            lock = advisory_call(key, "pg_try_advisory_lock"),
            limit = self.limit
        )
    }

    /// A permit's release: its slot's key and the name's shared key, and a wake-up for waiters
    /// (`NOTIFY`, with `$1`, the name, as payload; sent at the statement's commit, after the unlocks).
    /// The slot's two ints are parameters from `$2`, then the name's key (`Params::key` of both). The
    /// idle bound stays (see [`advisory_release`]).
    pub(crate) fn release_permit(&self, key: AdvisoryKey) -> String {
        format!(
            "SELECT {}, {}, pg_notify('{}', $1)",
            advisory_call_at(AdvisoryKey::Pair(0, 0), "pg_advisory_unlock", 2),
            advisory_call_at(key, "pg_advisory_unlock_shared", 4),
            self.channel
        )
    }

    /// Row mode: makes sure the name's row exists (autocommit).
    pub(crate) fn ensure_row(&self) -> String {
        format!(
            "INSERT INTO {} (name) VALUES ($1) ON CONFLICT (name) DO NOTHING",
            self.locks
        )
    }

    /// Row mode: locks the name's row inside the held transaction, `FOR UPDATE` (mutex, write) or
    /// `FOR SHARE` (read, `shared`); `nowait` for a try.
    pub(crate) fn lock_row(&self, nowait: bool, shared: bool) -> String {
        format!(
            "SELECT 1 FROM {} WHERE name = $1 FOR {}{}",
            self.locks,
            if shared { "SHARE" } else { "UPDATE" },
            if nowait { " NOWAIT" } else { "" }
        )
    }

    /// Lease mode: takes the lease of `$1` for owner `$2` for `$3` ms if it is free or expired;
    /// returns the new version (the token), or no row when it is held.
    pub(crate) fn take_lease(&self) -> String {
        format!(
            "INSERT INTO {locks} AS l (name, owner, expires_at, version) \
             VALUES ($1, $2, now() + $3::bigint * interval '1 millisecond', 1) \
             ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, \
             expires_at = EXCLUDED.expires_at, version = l.version + 1 \
             WHERE l.owner IS NULL OR l.expires_at <= now() RETURNING version",
            locks = self.locks
        )
    }

    /// Lease mode: the holder of `$1` and its remaining lease in ms.
    pub(crate) fn lease_holder(&self) -> String {
        format!(
            "SELECT owner, version, GREATEST(0, CEIL(EXTRACT(EPOCH FROM (expires_at - now())) * 1000))::bigint \
             FROM {} WHERE name = $1 AND owner IS NOT NULL AND expires_at > now()",
            self.locks
        )
    }

    /// Lease mode: renews every `(name, owner, version, ttl ms)` of the arrays `$1..$4` that is still
    /// the holder's and unexpired, in one statement; returns the names renewed.
    pub(crate) fn renew_leases(&self) -> String {
        format!(
            "UPDATE {locks} AS l SET expires_at = now() + u.ttl * interval '1 millisecond' \
             FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[]) AS u(name, owner, version, ttl) \
             WHERE l.name = u.name AND l.owner = u.owner AND l.version = u.version AND l.expires_at > now() \
             RETURNING l.name",
            locks = self.locks
        )
    }

    /// Lease mode: frees `$1` if owner `$2` holds it at version `$3` and the lease has not expired, and
    /// wakes the waiters. Returns one row: whether it freed it, and the row as it was before (owner,
    /// version, whether expired), so the caller tells "expired while still ours" (the hold was lost)
    /// from "already freed at our version" (an earlier attempt of this release was applied) from
    /// "taken over since". An expired lease is left as it is: only a release (or an abandon) clears the
    /// owner at a version, so a cleared owner at our version always means our release.
    pub(crate) fn release_lease(&self) -> String {
        format!(
            "WITH r AS (UPDATE {locks} SET owner = NULL, expires_at = NULL \
             WHERE name = $1 AND owner = $2 AND version = $3 AND expires_at > now() RETURNING name), \
             n AS (SELECT pg_notify('{channel}', name) FROM r) \
             SELECT (SELECT count(*) FROM n) > 0, l.owner, l.version, l.expires_at <= now() \
             FROM (SELECT 1) AS one LEFT JOIN {locks} AS l ON l.name = $1",
            locks = self.locks,
            channel = self.channel
        )
    }

    /// Lease mode: frees `$1` if owner `$2` holds it at any version (undoing a grant whose reply was
    /// lost) and wakes the waiters.
    pub(crate) fn release_lease_of_owner(&self) -> String {
        format!(
            "WITH r AS (UPDATE {locks} SET owner = NULL, expires_at = NULL \
             WHERE name = $1 AND owner = $2 RETURNING name) \
             SELECT pg_notify('{channel}', name) FROM r",
            locks = self.locks,
            channel = self.channel
        )
    }

    /// Lease mode, `distlock break`: expires the lease of `$1` if owner `$2` holds it unexpired (at
    /// version `$3`, unless `NULL`), and wakes the waiters. The owner stays, so the broken holder's
    /// renewal and release find their lease expired (lost), never released by them. The expiry is
    /// `-infinity`, not `now()`: a renewal whose statement began before this one (its `now()` earlier)
    /// and waited for the row re-checks `expires_at > now()` on the row this statement left, which a
    /// break at `now()` would pass (and the renewal would undo the break); no `now()` is below
    /// `-infinity`, and every statement that takes a lease (`expires_at <= now()`) finds it free.
    /// Returns whether it was expired.
    pub(crate) fn break_lease(&self) -> String {
        format!(
            "WITH b AS (UPDATE {locks} SET expires_at = '-infinity' \
             WHERE name = $1 AND owner = $2 AND ($3::bigint IS NULL OR version = $3) AND expires_at > now() \
             RETURNING name), \
             n AS (SELECT pg_notify('{channel}', name) FROM b) \
             SELECT (SELECT count(*) FROM n) > 0",
            locks = self.locks,
            channel = self.channel
        )
    }

    /// Advisory mode, `distlock break`, one statement: terminates backend `$4` if it holds the key
    /// (`pg_locks`' `$1`, `$2`, `$3`: classid, objid, objsubid) exclusive, its session started at `$5`
    /// (unless `NULL`), and the hold is the one shown: a session that stayed idle since its state
    /// changed at `$9` (when given: a holder that is not distlock's, see [`HoldId`]), or else one of
    /// distlock's sessions ([`DISTLOCK_SESSION`]) while the counter of `$7` is `$6` (unless `NULL`),
    /// waiting up to `$8` ms for it to exit.
    ///
    /// The counter is read `FOR SHARE SKIP LOCKED`: a grant's bump of it in flight (the lock taken,
    /// the token not yet committed) makes it skip, so nothing matches (that holder's hold is gone: the
    /// session is acquiring again); otherwise the row stays locked until this statement ends, so no
    /// bump (no new grant) of the name commits before the backend is terminated. The check and the
    /// signal are one statement, not one atomic step: `pg_locks` is read first, then the signal is
    /// sent microseconds later (see the engine docs). Returns the backends matched (0 or 1), whether
    /// they exited in time, whether backend `$4` holds the key shared (a reader, a permit holder),
    /// and whether the session holding it exclusive as `$4` is not distlock's (`NULL` when none does).
    pub(crate) fn break_advisory(&self) -> String {
        format!(
            "WITH f AS MATERIALIZED (SELECT token FROM {fence} WHERE name = $7 FOR SHARE SKIP LOCKED), \
             h AS (SELECT l.pid, {DISTLOCK_SESSION} AS ours, a.backend_start, a.state, a.state_change \
               FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
               WHERE {PG_LOCKS_KEY} AND l.granted AND l.mode = 'ExclusiveLock' \
               AND l.pid = $4 AND l.pid <> pg_backend_pid()), \
             ok AS (SELECT pid FROM h WHERE ($5::timestamptz IS NULL OR backend_start = $5) \
               AND CASE WHEN $9::timestamptz IS NOT NULL THEN state = 'idle' AND state_change = $9 \
                 ELSE ours AND ($6::bigint IS NULL OR (SELECT token FROM f) = $6) END), \
             k AS (SELECT pg_terminate_backend(pid, $8::bigint) AS done FROM ok) \
             SELECT (SELECT count(*) FROM ok), (SELECT bool_and(done) FROM k), \
               EXISTS (SELECT 1 FROM pg_locks l WHERE {PG_LOCKS_KEY} AND l.granted AND l.mode = 'ShareLock' \
                 AND l.pid = $4), \
               (SELECT bool_or(NOT ours) FROM h)",
            fence = self.fence
        )
    }

    /// Row mode: the backend whose transaction holds `$1`'s row exclusive (`FOR UPDATE`). A row lock
    /// is no `pg_locks` entry: the locker's transaction id is the row's `xmax`, and every transaction
    /// holds its own id exclusive in `pg_locks`. Exclusive is told by a `FOR SHARE SKIP LOCKED` that
    /// skips the row (a reader's `FOR SHARE` does not make it skip; `xmax` alone cannot tell a single
    /// reader from a writer). Returns its pid, client address, transaction start, `application_name`
    /// and transaction id (the hold's identity: every hold is a transaction of its own), or no row.
    pub(crate) fn row_holder(&self) -> String {
        format!(
            "WITH free AS (SELECT 1 FROM {locks} WHERE name = $1 FOR SHARE SKIP LOCKED) \
             SELECT l.pid, host(a.client_addr), a.xact_start, a.application_name, t.xmax::text \
             FROM {locks} t JOIN pg_locks l ON {row_locker} \
             LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE t.name = $1 AND l.pid <> pg_backend_pid() AND NOT EXISTS (SELECT 1 FROM free)",
            locks = self.locks,
            row_locker = ROW_LOCKER
        )
    }

    /// Row mode, once `$1`'s row is known to be locked ([`Tables::row_locked`]): its readers, none
    /// when it is held exclusive (a `FOR SHARE SKIP LOCKED` that skips it, as in
    /// [`Tables::row_holder`]). A single reader's transaction id is the row's `xmax` (held by a live
    /// transaction in `pg_locks`); several readers share a multixact there, whose members
    /// `pg_get_multixact_members` lists (only called on an `xmax` that names no live transaction, which
    /// is then a multixact: a strict function, given `NULL` otherwise). Returns, per reader, what
    /// [`Tables::row_holder`] returns of a writer.
    pub(crate) fn row_readers(&self) -> String {
        format!(
            "WITH free AS (SELECT 1 FROM {locks} WHERE name = $1 FOR SHARE SKIP LOCKED), \
             r AS (SELECT t.xmax, EXISTS (SELECT 1 FROM pg_locks s WHERE s.locktype = 'transactionid' \
               AND s.transactionid = t.xmax AND s.mode = 'ExclusiveLock' AND s.granted) AS single \
               FROM {locks} t WHERE t.name = $1), \
             x AS (SELECT r.xmax AS xid FROM r WHERE r.single \
               UNION ALL SELECT m.xid FROM r, \
               pg_get_multixact_members(CASE WHEN r.single OR r.xmax = '0'::xid THEN NULL ELSE r.xmax END) m) \
             SELECT l.pid, host(a.client_addr), a.xact_start, a.application_name, x.xid::text \
             FROM x JOIN pg_locks l ON l.locktype = 'transactionid' AND l.transactionid = x.xid \
               AND l.mode = 'ExclusiveLock' AND l.granted \
             LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.pid <> pg_backend_pid() AND EXISTS (SELECT 1 FROM free) ORDER BY l.pid",
            locks = self.locks
        )
    }

    /// Row mode, `distlock break`, one statement: terminates backend `$2` if its transaction holds
    /// `$1`'s row exclusive ([`Tables::row_holder`]), that transaction is `$3` (the hold shown, unless
    /// `NULL`: a later hold of the same session is another transaction) and the counter of `$1` is
    /// `$4` (unless `NULL`), waiting up to `$5` ms for it to exit. As in advisory mode the row's
    /// locker is read, then the signal sent microseconds later, in one statement. Returns the backends
    /// matched (0 or 1) and whether they exited in time.
    pub(crate) fn break_row(&self) -> String {
        format!(
            "WITH free AS (SELECT 1 FROM {locks} WHERE name = $1 FOR SHARE SKIP LOCKED), \
             h AS (SELECT l.pid FROM {locks} t JOIN pg_locks l ON {row_locker} \
               WHERE t.name = $1 AND l.pid = $2 AND l.pid <> pg_backend_pid() \
               AND ($3::text IS NULL OR t.xmax::text = $3) \
               AND ($4::bigint IS NULL OR (SELECT token FROM {fence} WHERE name = $1) = $4) \
               AND NOT EXISTS (SELECT 1 FROM free)), \
             k AS (SELECT pg_terminate_backend(pid, $5::bigint) AS done FROM h) \
             SELECT (SELECT count(*) FROM h), (SELECT bool_and(done) FROM k)",
            locks = self.locks,
            fence = self.fence,
            row_locker = ROW_LOCKER
        )
    }

    /// Row mode: whether `$1`'s row exists and whether it is locked against `FOR UPDATE` (tried with
    /// `SKIP LOCKED`, autocommit: a free row is held for this one statement). Once no exclusive holder
    /// was found, a row locked so is held by readers.
    pub(crate) fn row_locked(&self) -> String {
        format!(
            "SELECT EXISTS (SELECT 1 FROM {locks} WHERE name = $1), \
             NOT EXISTS (SELECT 1 FROM (SELECT 1 FROM {locks} WHERE name = $1 FOR UPDATE SKIP LOCKED) s)",
            locks = self.locks
        )
    }

    /// `LISTEN` on the wake-up channel.
    pub(crate) fn listen(&self) -> String {
        format!("LISTEN \"{}\"", self.channel)
    }

    /// `UNLISTEN` on the wake-up channel.
    pub(crate) fn unlisten(&self) -> String {
        format!("UNLISTEN \"{}\"", self.channel)
    }
}

/// The session settings of a connection that holds a lock, and the probe: `ttl_ms` is the idle limit
/// after which the server ends the session (and frees its locks) unless another statement comes.
/// One statement (`set_config(…, false)` is `SET`, transactional alike), so a probe costs the server
/// one statement, not three.
pub(crate) fn session_bound(ttl_ms: u64) -> String {
    format!(
        "SELECT pg_backend_pid(), set_config('idle_session_timeout', '{ttl_ms}', false), \
         set_config('idle_in_transaction_session_timeout', '{ttl_ms}', false)"
    )
}

/// [`session_bound`] as a prepared statement: the idle bound is `$1` (text, milliseconds). It stays a
/// statement of its own, sent ahead of a try's lock statement in the same round trip, so the bound is
/// committed whatever that statement does: folded into it, an error after its lock function (a
/// cancel, a failed counter bump) would roll the bound back with the lock still held, and a client
/// cut off then would keep the lock until the server's TCP keepalive (session 33 found it; a fold in
/// session 34 brought it back and was undone).
pub(crate) const PROBE: &str =
    "SELECT pg_backend_pid(), set_config('idle_session_timeout', $1, false), \
     set_config('idle_in_transaction_session_timeout', $1, false)";

/// A read lock's try: `pg_try_advisory_lock_shared` on the key in the parameters from `$1`
/// (`Params::key`).
pub(crate) fn try_lock_shared(key: AdvisoryKey) -> String {
    format!(
        "SELECT {}",
        advisory_call_at(key, "pg_try_advisory_lock_shared", 1)
    )
}

/// The idle bounds back to off (not `RESET`, which would restore the server's or role's default,
/// whatever it is).
pub(crate) fn reset_bound() -> String {
    "SELECT set_config('idle_session_timeout', '0', false), \
     set_config('idle_in_transaction_session_timeout', '0', false)"
        .to_string()
}

/// A session lock's release: `function` (`pg_advisory_unlock` or `_shared`) on the key in the
/// parameters from `$1` (`Params::key`). The idle bound stays: the connection goes back to the pool
/// with it, so the next try with the same lease sends no probe, and the pool resets it before the
/// server would end the idle session.
pub(crate) fn advisory_release(key: AdvisoryKey, function: &str) -> String {
    format!("SELECT {}", advisory_call_at(key, function, 1))
}

/// `function` on a key passed as parameters from `$n`: `$n` a `bigint` for a one-`bigint` key, `$n`
/// and `$n+1` `integer`s for a two-int key. The statement's text depends on the key's shape only, so
/// one prepared statement serves every name.
fn advisory_call_at(key: AdvisoryKey, function: &str, n: usize) -> String {
    match key {
        AdvisoryKey::Single(_) => format!("{function}(${n}::bigint)"),
        AdvisoryKey::Pair(..) => format!("{function}(${n}::integer, ${}::integer)", n + 1),
    }
}

/// How many parameters a key takes ([`advisory_call_at`]).
fn key_arity(key: AdvisoryKey) -> usize {
    match key {
        AdvisoryKey::Single(_) => 1,
        AdvisoryKey::Pair(..) => 2,
    }
}

/// Advisory mode, `distlock status`: every session in `pg_locks` on the key in `$1`, `$2`, `$3`
/// (classid, objid, objsubid), granted or waiting, with what `pg_stat_activity` shows of it: pid,
/// granted, client address, session start, lock mode, `application_name`, state, last state
/// change, and whether it is one of distlock's sessions ([`DISTLOCK_SESSION`]). The session
/// columns other than `application_name` are `NULL` for another role's session unless this role
/// has `pg_read_all_stats`.
pub(crate) fn advisory_holders() -> String {
    format!(
        "SELECT l.pid, l.granted, host(a.client_addr), a.backend_start, l.mode, a.application_name, \
         a.state, a.state_change, {DISTLOCK_SESSION} \
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE {PG_LOCKS_KEY}"
    )
}

/// A `pg_locks l` row of the advisory key in `$1`, `$2`, `$3` (classid, objid, objsubid, as
/// [`pg_locks_row`] gives them), in this database (an advisory key is per database).
const PG_LOCKS_KEY: &str = "l.locktype = 'advisory' AND l.classid = $1::bigint::oid \
                            AND l.objid = $2::bigint::oid AND l.objsubid = $3::smallint \
                            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// Joins a row `t` to the `pg_locks l` entry of the transaction in its `xmax` (its locker, see
/// [`Tables::row_holder`]).
const ROW_LOCKER: &str = "l.locktype = 'transactionid' AND l.transactionid = t.xmax \
                          AND l.mode = 'ExclusiveLock' AND l.granted";

/// Whether the `pg_stat_activity a` row is one of distlock's sessions: its `application_name` is
/// `distlock` (distlock's default) or this session's own (the URL's `application_name`, when the
/// operator uses the holders' URL). A session holding the name that is not distlock's (`psql`, .NET
/// DistributedLock, an application's own connection) mints no token, so a break cannot tell its
/// hold from a later one of the same session by the token (see [`HoldId`]).
const DISTLOCK_SESSION: &str =
    "(a.application_name IN ('distlock', current_setting('application_name')))";

/// The identity of one hold (`HolderInfo::hold_id`), as `inspect` shows it and `distlock break`
/// compares it, in text: a word for the mode and the kind, then `key=value` fields.
///
/// * `row exclusive xid=<n>` / `row shared xid=<n>`: row mode; the transaction that holds the row
///   (its `xmax`, or a member of its multixact). Every hold of the row is a transaction of its own, so
///   a later hold, even of the same session, has another id.
/// * `advisory exclusive [session=<µs>] [idle=<µs>]` / `advisory shared [session=<µs>]`: advisory
///   mode; `session` is the holder's `backend_start` (microseconds since 1970), which tells a
///   session from a later one given the same pid; `idle` is, for a holder that is not one of
///   distlock's sessions (which mint no token), the `state_change` of its session, idle when shown:
///   the break ends it only if it is still idle since then (a session that took the lock again
///   has run statements since). Both need the privileges to read the session's activity
///   (`pg_read_all_stats`, or its role), and are left out without them.
///
/// ```text
/// row exclusive xid=7312
/// advisory exclusive session=1714566896123456
/// advisory exclusive session=1714566896123456 idle=1714566990654321
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldId {
    /// Advisory mode.
    Advisory {
        shared: bool,
        /// `backend_start`, microseconds since 1970.
        session: Option<i64>,
        /// A foreign holder's idle `state_change`, microseconds since 1970.
        idle: Option<i64>,
    },
    /// Row mode.
    Row { shared: bool, xid: u32 },
}

impl HoldId {
    /// Whether the hold is a shared one (a reader's, a permit's).
    pub(crate) fn shared(&self) -> bool {
        match self {
            HoldId::Advisory { shared, .. } | HoldId::Row { shared, .. } => *shared,
        }
    }

    /// Reads one back; `None` if it is not one of these.
    pub(crate) fn parse(text: &str) -> Option<HoldId> {
        let mut words = text.split_whitespace();
        let mode = words.next()?;
        let shared = match words.next()? {
            "exclusive" => false,
            "shared" => true,
            _ => return None,
        };
        let (mut session, mut idle, mut xid) = (None, None, None);
        for field in words {
            let (key, value) = field.split_once('=')?;
            match key {
                "session" => session = Some(value.parse().ok()?),
                "idle" => idle = Some(value.parse().ok()?),
                "xid" => xid = Some(value.parse().ok()?),
                _ => return None,
            }
        }
        match mode {
            "advisory" if xid.is_none() => Some(HoldId::Advisory {
                shared,
                session,
                idle,
            }),
            "row" if session.is_none() && idle.is_none() => Some(HoldId::Row { shared, xid: xid? }),
            _ => None,
        }
    }
}

impl std::fmt::Display for HoldId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = |shared: bool| if shared { "shared" } else { "exclusive" };
        match self {
            HoldId::Row { shared, xid } => write!(f, "row {} xid={xid}", kind(*shared)),
            HoldId::Advisory {
                shared,
                session,
                idle,
            } => {
                write!(f, "advisory {}", kind(*shared))?;
                if let Some(session) = session {
                    write!(f, " session={session}")?;
                }
                if let Some(idle) = idle {
                    write!(f, " idle={idle}")?;
                }
                Ok(())
            }
        }
    }
}

/// A time as [`HoldId`] keeps it: microseconds since 1970 (`None` before it).
pub(crate) fn micros_since_epoch(time: std::time::SystemTime) -> Option<i64> {
    let since = time.duration_since(std::time::UNIX_EPOCH).ok()?;
    i64::try_from(since.as_micros()).ok()
}

/// The time of [`micros_since_epoch`] back.
pub(crate) fn time_of_micros(micros: i64) -> Option<std::time::SystemTime> {
    let micros = u64::try_from(micros).ok()?;
    std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_micros(micros))
}

/// How `inspect` shows a holder's session in `HolderInfo::host`: its client address (`local socket`
/// for a unix socket) and its `application_name`, which tells distlock's sessions (`distlock`, or the
/// URL's) from others (`psql`, an application's own connection).
pub(crate) fn session_host(addr: Option<String>, application: Option<String>) -> Option<String> {
    match (addr, application) {
        (addr, Some(app)) => Some(format!(
            "{}, application_name {app:?}",
            addr.as_deref().unwrap_or("local socket")
        )),
        (addr, None) => addr,
    }
}

/// How `inspect` shows a session's holder in advisory and row modes, as `HolderInfo::owner`: the
/// server's backend pid (a process of the database server, not of the holder's machine, so not
/// `HolderInfo::pid`). `distlock break` reads it back.
pub(crate) const BACKEND_OWNER_PREFIX: &str = "postgres backend ";

/// The owner `inspect` shows for backend `pid`.
pub(crate) fn backend_owner(pid: i32) -> String {
    format!("{BACKEND_OWNER_PREFIX}{pid}")
}

/// Set by every session distlock opens, first thing, so no server, database or role default breaks
/// its statements: READ COMMITTED (a lease upsert under REPEATABLE READ or SERIALIZABLE fails with a
/// serialization error when waiters race; the row lock's `FOR UPDATE` relies on it too), no statement or
/// lock timeout (every statement has distlock's own client-side bound, and waits are sliced by
/// [`wait_slice`]), no idle limits (a held session sets its own, see [`session_bound`]), and generic
/// plans for the prepared statements (`Conn::query_one_cached`): their keys are parameters, and a
/// custom plan per execution would plan them each time, which preparing them is there to avoid.
/// `set_config` through `pg_settings` sets only what the server knows, so PostgreSQL before 14 (no
/// `idle_session_timeout`) is not refused in lease mode.
pub(crate) const SESSION_SETTINGS: &str =
    "SELECT count(set_config(name, value, false)) FROM (VALUES \
     ('default_transaction_isolation', 'read committed'), ('statement_timeout', '0'), \
     ('lock_timeout', '0'), ('idle_in_transaction_session_timeout', '0'), \
     ('idle_session_timeout', '0'), ('plan_cache_mode', 'force_generic_plan')) AS s(name, value) \
     WHERE name IN (SELECT name FROM pg_settings)";

/// Set once on a connection that holds or waits for a lock: a waiting query notices its client is
/// gone within 250 ms.
pub(crate) const HOLDER_SETTINGS: &str = "SET client_connection_check_interval = 250";

/// Bounds the next lock wait on the server to one slice of `slice_ms`: a wait that ends with
/// `lock_timeout` (SQLSTATE 55P03) tells the client its connection is alive, so a wait that gets no
/// answer within the slice plus the request bound is on a dead connection.
pub(crate) fn wait_slice(slice_ms: u64, local: bool) -> String {
    let scope = if local { "LOCAL " } else { "" };
    format!("SET {scope}lock_timeout = {slice_ms}")
}

/// Advisory mode statements for a key.
pub(crate) fn advisory(key: AdvisoryKey, function: &str) -> String {
    format!("SELECT {}", advisory_call(key, function))
}

/// A server-side wait's lock statement: `function` (`pg_advisory_lock` or `_shared`) on the key, and
/// `pg_backend_pid()`, so the grant is checked to be this connection's own session.
pub(crate) fn advisory_wait(key: AdvisoryKey, function: &str) -> String {
    format!("SELECT {}, pg_backend_pid()", advisory_call(key, function))
}

/// An exclusive server-side wait's lock statement: `pg_advisory_lock` on the key and, in the same
/// statement once it is granted, the fencing counter bump of `name` (in `fence`), as a try's
/// [`Tables::try_lock_and_next_token`] does: the grant's token is committed with the message that
/// got the lock, not by a later statement (a break in between would find the lock held with the
/// previous hold's token). Returns the new token and `pg_backend_pid()`. Sent in a simple query
/// (no parameters): the name is a hex literal, which no server setting reads differently.
pub(crate) fn advisory_wait_minting(key: AdvisoryKey, fence: &str, name: &str) -> String {
    format!(
        "WITH l AS (SELECT {lock} AS got), \
         t AS (INSERT INTO {fence} AS f (name, token) SELECT {name}, 1 FROM l \
         ON CONFLICT (name) DO UPDATE SET token = f.token + 1 RETURNING token) \
         SELECT (SELECT token FROM t), pg_backend_pid()",
        lock = advisory_call(key, "pg_advisory_lock"),
        name = text_literal(name)
    )
}

/// A text literal of `text` that reads the same whatever `standard_conforming_strings` says: its
/// UTF-8 bytes in hex, decoded by the server.
fn text_literal(text: &str) -> String {
    let hex: String = text.bytes().map(|b| format!("{b:02x}")).collect();
    format!("convert_from(decode('{hex}', 'hex'), 'UTF8')")
}

/// Releases every session advisory lock of the session, if it is still `pid` (through a pooler it could
/// be another client's session): the undo of an abandoned acquire.
pub(crate) fn unlock_all_of(pid: i32) -> String {
    format!("SELECT pg_advisory_unlock_all() FROM (SELECT 1) s WHERE pg_backend_pid() = {pid}")
}

/// Downgrades the session's exclusive hold of `key` to a shared one: the shared lock first (granted at
/// once: the session's own exclusive lock does not conflict, and PostgreSQL puts a request that only
/// waiters conflict with ahead of them when the session holds a lock they wait for), bounded by a wait
/// slice of `slice_ms` in case it is not, then the exclusive one let go. One simple query; if the
/// shared lock fails, the rest is skipped and the exclusive hold stays. The last row is the unlock's.
pub(crate) fn downgrade(key: AdvisoryKey, slice_ms: u64) -> String {
    format!(
        "{}; {}; {}; {}",
        wait_slice(slice_ms, false),
        advisory(key, "pg_advisory_lock_shared"),
        wait_slice(0, false),
        advisory(key, "pg_advisory_unlock")
    )
}

/// The two ints of a two-int key (a one-`bigint` key as its halves, as `pg_locks` shows it).
pub(crate) fn pair(key: AdvisoryKey) -> (i32, i32) {
    match key {
        AdvisoryKey::Pair(a, b) => (a, b),
        AdvisoryKey::Single(k) => ((k >> 32) as i32, k as i32),
    }
}

/// `function(key)`, the call alone.
fn advisory_call(key: AdvisoryKey, function: &str) -> String {
    match key {
        // Cast: the most negative value's literal is read as a wider type (its digits before the sign).
        AdvisoryKey::Pair(a, b) => format!("{function}(({a})::integer, ({b})::integer)"),
        AdvisoryKey::Single(k) => format!("{function}(({k})::bigint)"),
    }
}
