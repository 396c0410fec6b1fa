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
//! ```
//!
//! Lease-mode releases `NOTIFY` the channel named after the table with the lock name as payload;
//! waiters `LISTEN` on it.

use sha1::{Digest, Sha1};

use crate::config::AdvisoryKey;

/// The key of the transaction-scoped advisory lock taken around the schema creation: the
/// [`advisory_key`] of `"distlock schema"`.
pub const SCHEMA_LOCK_KEY: &str = "distlock schema";

/// The suffix of the fencing counter table's name.
pub const FENCE_SUFFIX: &str = "_fence";

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
             COMMIT",
            locks = self.locks,
            fence = self.fence
        )
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
    pub(crate) fn try_lock_and_next_token(&self, key: AdvisoryKey) -> String {
        let lock = advisory_call(key, "pg_try_advisory_lock");
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

    /// Row mode: makes sure the name's row exists (autocommit).
    pub(crate) fn ensure_row(&self) -> String {
        format!(
            "INSERT INTO {} (name) VALUES ($1) ON CONFLICT (name) DO NOTHING",
            self.locks
        )
    }

    /// Row mode: locks the name's row inside the held transaction; `nowait` for a try.
    pub(crate) fn lock_row(&self, nowait: bool) -> String {
        format!(
            "SELECT 1 FROM {} WHERE name = $1 FOR UPDATE{}",
            self.locks,
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

    /// Lease mode: frees `$1` if owner `$2` holds it at version `$3` and wakes the waiters.
    pub(crate) fn release_lease(&self) -> String {
        format!(
            "WITH r AS (UPDATE {locks} SET owner = NULL, expires_at = NULL \
             WHERE name = $1 AND owner = $2 AND version = $3 RETURNING name) \
             SELECT pg_notify('{channel}', name) FROM r",
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

    /// `LISTEN` on the wake-up channel.
    pub(crate) fn listen(&self) -> String {
        format!("LISTEN \"{}\"", self.channel)
    }
}

/// The session settings of a connection that holds a lock, and the probe: `ttl_ms` is the idle limit
/// after which the server ends the session (and frees its locks) unless another statement comes.
pub(crate) fn session_bound(ttl_ms: u64) -> String {
    format!(
        "SET idle_session_timeout = {ttl_ms}; SET idle_in_transaction_session_timeout = {ttl_ms}; \
         SELECT pg_backend_pid()"
    )
}

/// Appended to a release that leaves the session clean, before the connection is reused.
pub(crate) const RESET_BOUND: &str =
    "RESET idle_session_timeout; RESET idle_in_transaction_session_timeout";

/// Set once on a connection that holds or waits for a lock: no statement or lock timeout from the
/// role's defaults cuts a wait short, and a waiting query notices its client is gone within 250 ms.
pub(crate) const HOLDER_SETTINGS: &str = "SET statement_timeout = 0; SET lock_timeout = 0; \
     SET client_connection_check_interval = 250";

/// Advisory mode statements for a key.
pub(crate) fn advisory(key: AdvisoryKey, function: &str) -> String {
    format!("SELECT {}", advisory_call(key, function))
}

/// Releases every session advisory lock of the session, if it is still `pid` (through a pooler it could
/// be another client's session): the undo of an abandoned acquire.
pub(crate) fn unlock_all_of(pid: i32) -> String {
    format!("SELECT pg_advisory_unlock_all() FROM (SELECT 1) s WHERE pg_backend_pid() = {pid}")
}

/// `function(key)`, the call alone.
fn advisory_call(key: AdvisoryKey, function: &str) -> String {
    match key {
        AdvisoryKey::Pair(a, b) => format!("{function}({a}, {b})"),
        AdvisoryKey::Single(k) => format!("{function}({k})"),
    }
}
