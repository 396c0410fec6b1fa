//! The whole on-server layout of the MariaDB / MySQL backend: the `GET_LOCK` name of a lock, the lock
//! table, and every statement distlock sends. Statements use the text protocol (one round trip, no
//! prepare); user data (names, owners) is sent as hex literals `X'…'`, so nothing needs escaping.

use sha2::{Digest as _, Sha256};

/// The prefix of every `GET_LOCK` name distlock uses.
pub const LOCK_NAME_PREFIX: &str = "dl:";
/// How many hex digits of the name's SHA-256 follow the prefix (240 bits).
const HASH_HEX_DIGITS: usize = 60;

/// The `GET_LOCK` name of a distlock lock name: `dl:` + the first 60 lowercase hex digits of the
/// SHA-256 of the name's UTF-8 bytes (63 characters in all).
///
/// MariaDB and MySQL compare lock names case-insensitively and refuse names over 64 characters; the
/// hash keeps `A` and `a` apart and takes every name distlock accepts (up to 1,024 bytes). This mapping
/// never changes: other applications lock the same name with `GET_LOCK(advisory_name(n), …)`.
///
/// ```
/// use distlock_sql::mysql::advisory_name;
/// assert_eq!(advisory_name("a"), "dl:ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee");
/// assert_eq!(advisory_name("A"), "dl:559aead08264d5795d3909718cdd05abd49572e84fe55590eef31a88a08f");
/// assert_eq!(advisory_name(&"x".repeat(1024)).len(), 63);
/// ```
pub fn advisory_name(name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    let mut out = String::with_capacity(LOCK_NAME_PREFIX.len() + HASH_HEX_DIGITS);
    out.push_str(LOCK_NAME_PREFIX);
    out.push_str(&hex(&digest)[..HASH_HEX_DIGITS]);
    out
}

/// The prefix of every semaphore slot's `GET_LOCK` name.
pub const PERMIT_NAME_PREFIX: &str = "dls:";
/// How many hex digits of the name's SHA-256 a slot name carries (192 bits): with the prefix, `#` and a
/// slot of up to five digits, at most 58 characters, under the server's 64.
const PERMIT_HASH_HEX_DIGITS: usize = 48;

/// The `GET_LOCK` name of permit `slot` (`0..N`) of the semaphore `name`: `dls:` + the first 48 hex
/// digits of the SHA-256 of the name (the same hash as [`advisory_name`]'s, shorter) + `#` + the slot
/// in decimal; at most 58 characters. A permit holder's session holds exactly one of them.
///
/// ```
/// use distlock_sql::mysql::{advisory_name, permit_name};
/// assert_eq!(permit_name("a", 0), "dls:ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72#0");
/// assert_eq!(permit_name("a", 65_535), "dls:ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72#65535");
/// assert!(advisory_name("a")[3..].starts_with(&permit_name("a", 7)[4..52]));
/// assert!(permit_name(&"x".repeat(1024), 65_535).len() <= 64);
/// ```
pub fn permit_name(name: &str, slot: u32) -> String {
    let digest = Sha256::digest(name.as_bytes());
    format!(
        "{PERMIT_NAME_PREFIX}{}#{slot}",
        &hex(&digest)[..PERMIT_HASH_HEX_DIGITS]
    )
}

/// The suffix of the semaphore limit table's name (`distlock_locks_limit` with the default table):
/// one row per semaphore name, written by its first permit and kept. To change a limit, once no permit
/// of it is held: `DELETE FROM distlock_locks_limit WHERE name = X'<hex of the name>'` (or
/// `WHERE name = 'workers'`).
///
/// ```
/// use distlock_sql::mysql::LIMIT_SUFFIX;
/// assert_eq!(format!("{}{LIMIT_SUFFIX}", distlock_sql::DEFAULT_TABLE), "distlock_locks_limit");
/// ```
pub const LIMIT_SUFFIX: &str = "_limit";

/// The longest table name MariaDB and MySQL accept: a `?table=` name longer than 58 characters leaves
/// no room for [`LIMIT_SUFFIX`], so that table's semaphores are refused (`InvalidConfig`).
pub(crate) const MAX_SERVER_IDENTIFIER_LEN: usize = 64;

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    out
}

/// A SQL hex literal of `bytes`: `X'…'` (`X''` for none).
pub(crate) fn literal(bytes: &[u8]) -> String {
    format!("X'{}'", hex(bytes))
}

/// The lock table's qualified, quoted name: `` `schema`.`table` `` or `` `table` ``. The names were
/// checked by `SqlConfig::validate` (letters, digits, `_`).
pub(crate) fn qualified(schema: Option<&str>, table: &str) -> String {
    match schema {
        Some(schema) => format!("`{schema}`.`{table}`"),
        None => format!("`{table}`"),
    }
}

/// The semaphore limit table, qualified and quoted: `` `…_limit` `` beside the lock table.
pub(crate) fn qualified_limit(schema: Option<&str>, table: &str) -> String {
    qualified(schema, &format!("{table}{LIMIT_SUFFIX}"))
}

/// The limit table: a semaphore name's number of permits, stored with its first permit and kept. A
/// name with a row is a semaphore for good: the mutex's try refuses it (see [`bump_fence_if_locked`]).
pub(crate) fn create_limit_table(limit_table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {limit_table} (\
         name VARBINARY(1024) NOT NULL PRIMARY KEY, \
         permits INT UNSIGNED NOT NULL\
         ) ENGINE=InnoDB"
    )
}

/// Reads every column of the limit table distlock uses.
pub(crate) fn check_limit_table(limit_table: &str) -> String {
    format!("SELECT name, permits FROM {limit_table} LIMIT 0")
}

/// The lock table: one row per name. `fence` is the name's counter, the fencing token of every mode
/// (the lease's version in `lease` mode); `owner` and `expires_at` (the database's clock, `NOW(6)`)
/// are the lease of `lease` mode, unused by the other modes.
pub(crate) fn create_table(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
         name VARBINARY(1024) NOT NULL PRIMARY KEY, \
         fence BIGINT UNSIGNED NOT NULL DEFAULT 0, \
         owner VARBINARY(256) NULL, \
         expires_at DATETIME(6) NULL\
         ) ENGINE=InnoDB"
    )
}

/// Reads every column distlock uses: fails (unknown column) on a table of another shape.
pub(crate) fn check_table(table: &str) -> String {
    format!("SELECT name, fence, owner, expires_at FROM {table} LIMIT 0")
}

/// How long a row-mode wait (`innodb_lock_wait_timeout`) and an advisory wait (`GET_LOCK(n, …)`)
/// last in the server before the core tries again; the client gives each slice this long plus the
/// request timeout, then counts the connection as dead (see `advisory::wait`).
pub(crate) const WAIT_SLICE_SECS: u64 = 10;

/// How long a permit waiter waits in the server on one slot (`GET_LOCK(slot, 1)`) before it tries
/// every slot again and waits on the next: the bound on noticing a permit freed on another slot.
pub(crate) const PERMIT_WAIT_SLICE_SECS: u64 = 1;

/// The `wait_timeout` a session gets when it connects (MariaDB's and MySQL's default, 8 h), so that
/// its idle limit is known whatever the server's global says; a hold sets it to the lease.
pub(crate) const IDLE_WAIT_TIMEOUT_SECS: u64 = 28_800;

/// The settings distlock's statements rely on, set by every session it opens, since a new session
/// inherits the server's global defaults, which may be anything (`SET GLOBAL autocommit = 0` would
/// leave every counter bump uncommitted, its row locked, and the token repeated once the session
/// ends):
///
/// * `autocommit = 1`: the counter bump, the lease statements and the row mode's `INSERT IGNORE` each
///   commit on their own; plain reads open no transaction that would keep a pooled session in one;
/// * `completion_type = 'NO_CHAIN'`: a `ROLLBACK` (row mode's release) ends the transaction, without
///   starting another (`CHAIN`) or closing the session (`RELEASE`);
/// * `REPEATABLE READ, READ WRITE`: InnoDB's default isolation, the one every statement was written
///   and tested under (`READ COMMITTED` is refused for writes under `binlog_format=STATEMENT`), and
///   writable whatever `transaction_read_only` says;
/// * `sql_mode`: a fixed, portable one, so no mode changes how the statements parse (`ANSI_QUOTES`,
///   MariaDB's `ORACLE`) and `NO_ENGINE_SUBSTITUTION` refuses to create the lock table on anything but
///   InnoDB (a MyISAM table has no row locks and no transactions);
/// * `sql_safe_updates = 0`, `innodb_lock_wait_timeout` = the wait slice, `wait_timeout` = 8 h (a hold
///   sets it to its lease), and on MariaDB `max_statement_time = 0` (in a `/*M! … */` comment, which
///   MySQL skips), so a server-wide statement limit never cuts a wait short.
pub(crate) fn session_setup() -> String {
    format!(
        "SET SESSION autocommit = 1, completion_type = 'NO_CHAIN', \
         sql_mode = 'STRICT_TRANS_TABLES,NO_ENGINE_SUBSTITUTION', sql_safe_updates = 0, \
         innodb_lock_wait_timeout = {WAIT_SLICE_SECS}, wait_timeout = {IDLE_WAIT_TIMEOUT_SECS} \
         /*M!, max_statement_time = 0 */; \
         SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ WRITE"
    )
}

/// The lock that serialises the table's creation (`CREATE TABLE IF NOT EXISTS` racing itself is
/// harmless on MariaDB, but the issue asks for it under a lock, and it costs one statement once).
pub(crate) const SCHEMA_LOCK: &str = "dl-schema";

/// Bumps and returns (through the OK packet's insert id) the name's counter, in one autocommit
/// statement. `LAST_INSERT_ID(expr)` makes `expr` the statement's insert id.
pub(crate) fn bump_fence(table: &str, name: &str) -> String {
    format!(
        "INSERT INTO {table} (name, fence) VALUES ({}, LAST_INSERT_ID(1)) \
         ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1)",
        literal(name.as_bytes())
    )
}

/// As [`bump_fence`], only when this session holds the `GET_LOCK` name `key` (sent after the
/// `GET_LOCK` in the same multi-statement query: one round trip; no row is written when the lock was
/// busy) and, given the limit table, the name has no semaphore limit there: a mutex that got `key` but
/// whose bump did not happen gives it back and fails with `KindConflict` (see [`try_permit`] for why a
/// mutex and permits never hold together).
pub(crate) fn bump_fence_if_locked(
    table: &str,
    limit_table: Option<&str>,
    name: &str,
    key: &str,
) -> String {
    format!(
        "INSERT INTO {table} (name, fence, owner) SELECT {lit}, LAST_INSERT_ID(1), {MINTER} FROM DUAL \
         WHERE IS_USED_LOCK('{key}') = CONNECTION_ID(){not_semaphore} \
         ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1), owner = {MINTER}",
        lit = literal(name.as_bytes()),
        not_semaphore = not_a_semaphore(limit_table, name)
    )
}

/// Advisory mode: what a mutex grant writes (committed, with its counter bump) in the name's row's
/// `owner` column, which only lease mode uses otherwise: the session that minted the name's last
/// token, as `inspect` shows a session (`mysql session <id>`, [`session_owner`]). A session holding the
/// name's `GET_LOCK` whose id is not there minted no token: it is not a distlock holder (a `mariadb`
/// shell, another application), and a break cannot tell its hold from a later one of that session.
const MINTER: &str = "CONCAT('mysql session ', CONNECTION_ID())";

/// The first statement of the mutex's try: `GET_LOCK(key, 0)` and `CONNECTION_ID()`. Given the limit
/// table, a name that has a limit row answers [`SEMAPHORE_NAME`] instead, without taking `key`: a
/// mutex probe of a semaphore name must not hold the name's mutex even for a moment, since a permit
/// whose bump sees it held is refused (and a permit waiter then failed with `KindConflict` though no
/// mutex was ever granted). The bump ([`bump_fence_if_locked`]) still checks the row after `GET_LOCK`,
/// which is what the names-are-one-kind order argument rests on.
pub(crate) fn try_mutex(limit_table: Option<&str>, name: &str, key: &str) -> String {
    match limit_table {
        Some(limit_table) => format!(
            "SELECT IF(EXISTS (SELECT 1 FROM {limit_table} WHERE name = {}), {SEMAPHORE_NAME}, \
             GET_LOCK('{key}', 0)), CONNECTION_ID()",
            literal(name.as_bytes())
        ),
        None => format!("SELECT GET_LOCK('{key}', 0), CONNECTION_ID()"),
    }
}

/// What [`try_mutex`] answers for a name that is a semaphore (`GET_LOCK` answers 1, 0 or `NULL`).
pub(crate) const SEMAPHORE_NAME: i64 = -1;

/// As [`bump_fence`] for a mutex that won a wait: only when the name has no semaphore limit.
pub(crate) fn bump_fence_unless_semaphore(
    table: &str,
    limit_table: Option<&str>,
    name: &str,
) -> String {
    format!(
        "INSERT INTO {table} (name, fence, owner) SELECT {lit}, LAST_INSERT_ID(1), {MINTER} FROM DUAL \
         WHERE 1{not_semaphore} \
         ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1), owner = {MINTER}",
        lit = literal(name.as_bytes()),
        not_semaphore = not_a_semaphore(limit_table, name)
    )
}

/// ` AND NOT EXISTS (…the name's limit row…)`, or nothing without a limit table.
fn not_a_semaphore(limit_table: Option<&str>, name: &str) -> String {
    match limit_table {
        Some(limit_table) => format!(
            " AND NOT EXISTS (SELECT 1 FROM {limit_table} WHERE name = {})",
            literal(name.as_bytes())
        ),
        None => String::new(),
    }
}

/// How many slots one permit try walks per statement (and per round trip): a semaphore of up to this
/// many permits is tried in one round trip; a larger one in `ceil(N / 256)` at most.
pub(crate) const SLOTS_PER_STATEMENT: u32 = 256;

/// Which slots a permit statement tries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slots {
    /// `GET_LOCK(slot, 0)` on `count` slots from `first`, wrapping at `limit`, stopping at the first got.
    Walk { first: u32, count: u32 },
    /// The slot this session got in a wait (already held: a second `GET_LOCK` would lock it twice).
    Won(u32),
}

/// A permit's try, two statements in one multi-statement query (one round trip):
///
/// 1. `@dl_slot` := the first slot got, `-1` when all those tried are busy, `NULL` when the stored
///    limit is not `limit` (nothing is tried then); also the stored limit and `CONNECTION_ID()`. `CASE`
///    evaluates its branches in order and stops at the first true one, so at most one slot is taken.
/// 2. the fencing counter's bump, only when a slot was got **and** the name's mutex
///    (`GET_LOCK(`[`advisory_name`]`)`) is free; its OK packet carries the token as insert id.
///
/// A slot got with no bump means the mutex is held: the caller gives the slot back and fails with
/// `KindConflict`. Names are one kind: a permit writes (commits) the limit row before it takes its slot
/// and checks the mutex after; a mutex takes `GET_LOCK` before its bump checks the limit row. If both
/// held, the permit's check saw the mutex free, so it ran before the mutex's `GET_LOCK`, so the row was
/// committed before the mutex's bump read it, and the mutex gave up: never both (both may refuse).
pub(crate) fn try_permit(
    table: &str,
    limit_table: &str,
    name: &str,
    limit: u32,
    slots: Slots,
) -> String {
    let lit = literal(name.as_bytes());
    let stored = format!("(SELECT permits FROM {limit_table} WHERE name = {lit})");
    let choose = match slots {
        Slots::Walk { first, count } => {
            let mut arms = String::from("CASE");
            for i in 0..count.min(limit) {
                let slot = (first + i) % limit.max(1);
                arms.push_str(&format!(
                    " WHEN GET_LOCK('{}', 0) = 1 THEN {slot}",
                    permit_name(name, slot)
                ));
            }
            arms.push_str(" ELSE -1 END");
            arms
        }
        Slots::Won(slot) => format!(
            "IF(IS_USED_LOCK('{}') = CONNECTION_ID(), {slot}, -1)",
            permit_name(name, slot)
        ),
    };
    format!(
        "SELECT @dl_slot := CASE WHEN {stored} <=> {limit} THEN {choose} END, {stored}, CONNECTION_ID(); \
         INSERT INTO {table} (name, fence) SELECT {lit}, LAST_INSERT_ID(1) FROM DUAL \
         WHERE @dl_slot >= 0 AND IS_USED_LOCK('{mutex}') IS NULL \
         ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1)",
        mutex = advisory_name(name)
    )
}

/// A semaphore's first permit stores its limit, unless the name's mutex is held (then the name stays
/// free to be a mutex, and the permit fails with `KindConflict`) or a row is there already (kept as
/// it is). Autocommit: committed before the permit's try.
pub(crate) fn store_limit(limit_table: &str, name: &str, limit: u32) -> String {
    format!(
        "INSERT INTO {limit_table} (name, permits) SELECT {}, {limit} FROM DUAL \
         WHERE IS_USED_LOCK('{}') IS NULL ON DUPLICATE KEY UPDATE permits = permits",
        literal(name.as_bytes()),
        advisory_name(name)
    )
}

/// The limit stored for a name (no row → no result).
pub(crate) fn read_limit(limit_table: &str, name: &str) -> String {
    format!(
        "SELECT permits FROM {limit_table} WHERE name = {}",
        literal(name.as_bytes())
    )
}

/// Gives back a permit's slot (only this session's hold of it).
pub(crate) fn release_slot(name: &str, slot: u32) -> String {
    format!("DO RELEASE_LOCK('{}')", permit_name(name, slot))
}

/// The holders (`IS_USED_LOCK`: a connection id, or `NULL`) of slots `first..first + count`, one
/// column each.
pub(crate) fn slot_holders(name: &str, first: u32, count: u32) -> String {
    let columns: Vec<String> = (first..first + count)
        .map(|slot| format!("IS_USED_LOCK('{}')", permit_name(name, slot)))
        .collect();
    format!("SELECT {}", columns.join(", "))
}

/// How `inspect` shows a session's holder (advisory, row) as `HolderInfo::owner`: the server's
/// `CONNECTION_ID()` of the session that holds the lock. `distlock break` reads it back.
pub(crate) const SESSION_OWNER_PREFIX: &str = "mysql session ";

/// The owner `inspect` shows for session `id`.
pub(crate) fn session_owner(id: u64) -> String {
    format!("{SESSION_OWNER_PREFIX}{id}")
}

/// Row mode: records the hold in the lock row, uncommitted, inside the held transaction (sent behind
/// the `SELECT … FOR UPDATE` in the same query, so it runs only when the row was got): the mark
/// `<CONNECTION_ID()>/<UUID()>`, the session and an id of this hold alone, so a later hold of the same
/// session (a pooled session the same process took again) has another mark. The transaction always
/// ends with `ROLLBACK` (a release, or the session's end), which takes the write back: only a read
/// that sees uncommitted rows ([`row_holder`]) ever sees it, and then only while that transaction
/// holds the row. It is what lets `inspect` name the holder and `distlock break` end that hold and no
/// other, without the `PROCESS` privilege InnoDB's lock tables need.
pub(crate) fn mark_row_holder(table: &str, row: &str) -> String {
    format!("UPDATE {table} SET owner = CONCAT(CONNECTION_ID(), '/', UUID()) WHERE name = {row}")
}

/// The session id in a row-mode mark ([`mark_row_holder`]; an older distlock's mark is the id alone).
pub(crate) fn mark_session(mark: &str) -> Option<u64> {
    mark.split('/').next()?.trim().parse().ok()
}

/// Row mode: the lock row's owner as committed (a consistent read, autocommit), then as the holding
/// transaction left it (read uncommitted: the isolation set for the next transaction only, which
/// that read is). One row: the uncommitted owner and the committed one. A mark there that is not
/// committed ([`mark_row_holder`]) is the write of a transaction still open, which holds the row.
/// Every read is a plain `SELECT` (`… INTO @v`): a subquery in a `SET` is a locking read in InnoDB,
/// which would wait for the holder.
pub(crate) fn row_holder(table: &str, row: &str) -> String {
    format!(
        "SET @dl_committed = NULL; SELECT owner INTO @dl_committed FROM {table} WHERE name = {row}; \
         SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED; \
         SELECT owner, @dl_committed FROM {table} WHERE name = {row}"
    )
}

/// The session's `HOST` (`address:port`) as `information_schema.PROCESSLIST` shows it (only with the
/// `PROCESS` privilege for another user's session), for `inspect`'s `HolderInfo::host`.
pub(crate) fn session_host(id_sql: &str) -> String {
    format!("(SELECT HOST FROM information_schema.PROCESSLIST WHERE ID = {id_sql})")
}

/// Advisory mode, `distlock status`: one row: the `GET_LOCK` holder of `key` (a connection id, or
/// `NULL`), the name's counter and its minter ([`MINTER`]), and the holder's `HOST`.
pub(crate) fn advisory_holder(table: &str, name: &str, key: &str) -> String {
    let lit = literal(name.as_bytes());
    format!(
        "SELECT IS_USED_LOCK('{key}'), (SELECT fence FROM {table} WHERE name = {lit}), \
         (SELECT owner FROM {table} WHERE name = {lit}), {}",
        session_host(&format!("IS_USED_LOCK('{key}')"))
    )
}

/// Runs `KILL CONNECTION id` if `@dl_break` (set by the statements before) is true, as a prepared
/// statement (`KILL` is a statement, not a function: it cannot sit inside a check's own statement),
/// so the check and the kill run back to back in the server with no round trip in between.
fn kill_if_flagged(id: u64) -> String {
    format!(
        "SET @dl_kill = IF(@dl_break, 'KILL CONNECTION {id}', 'DO 0'); \
         PREPARE dl_break FROM @dl_kill; EXECUTE dl_break; DEALLOCATE PREPARE dl_break"
    )
}

/// Row mode, `distlock break` of the hold whose mark ([`mark_row_holder`]) is `mark` (a whole mark,
/// or, for a holder given without one, `<id>/` and anything after) on session `id`: the lock row's
/// owner as committed is read first; then, read uncommitted, the check that the mark is there and not
/// committed (the transaction that wrote it is open, so it holds the row) and, given `token`, the
/// name's counter is it; then the kill, prepared from what the check found. The last statement
/// answers whether the kill was sent.
pub(crate) fn break_row(
    table: &str,
    row: &str,
    name: &str,
    id: u64,
    mark: Option<&str>,
    token: Option<u64>,
) -> String {
    let owner = format!("(SELECT owner FROM {table} WHERE name = {row})");
    let (matches, committed) = match mark {
        Some(mark) => {
            let mark = literal(mark.as_bytes());
            (
                format!("{owner} <=> {mark}"),
                format!("@dl_committed <=> {mark}"),
            )
        }
        None => {
            let prefix = literal(format!("{id}/").as_bytes());
            (
                format!(
                    "(LEFT({owner}, {len}) <=> {prefix} OR {owner} <=> '{id}')",
                    len = id.to_string().len() + 1
                ),
                format!("@dl_committed <=> {owner}"),
            )
        }
    };
    format!(
        "SET @dl_committed = NULL; SELECT owner INTO @dl_committed FROM {table} WHERE name = {row}; \
         SET TRANSACTION ISOLATION LEVEL READ UNCOMMITTED; \
         SELECT ({matches} AND NOT ({committed}){fence}) INTO @dl_break; \
         {kill}; \
         SELECT @dl_break",
        fence = fence_is(table, name, token),
        kill = kill_if_flagged(id)
    )
}

/// Advisory mode, `distlock break` of session `id`'s hold of the `GET_LOCK` name `key` with `token`
/// (`None`: a holder given without one), in one query inside one transaction: the name's row is read
/// `FOR UPDATE SKIP LOCKED` (a grant's counter bump in flight, the lock taken and the token not yet
/// committed, makes it skip: that session is acquiring again, and the hold shown is gone; otherwise
/// the row stays locked until the `COMMIT`, after the kill, so no grant of the name can commit a
/// token before it); then the check: `id` holds `key`, it minted the name's last token ([`MINTER`]:
/// a distlock holder), and the counter is `token`; then the kill, prepared from what the check found.
/// The last statement answers: whether the kill was sent, whether the row was read (`0`: skipped or
/// missing), whether it exists, whether `id` held `key`, and whether `id` minted the last token.
pub(crate) fn break_advisory(
    table: &str,
    name: &str,
    key: &str,
    id: u64,
    token: Option<u64>,
) -> String {
    let lit = literal(name.as_bytes());
    let fence = token.map_or_else(String::new, |t| format!(" AND @dl_fence <=> {t}"));
    format!(
        "SET @dl_got = 0, @dl_fence = NULL, @dl_minter = NULL; \
         SELECT COUNT(*) INTO @dl_exists FROM {table} WHERE name = {lit}; \
         START TRANSACTION; \
         SELECT 1, fence, owner INTO @dl_got, @dl_fence, @dl_minter FROM {table} WHERE name = {lit} \
           FOR UPDATE SKIP LOCKED; \
         SET @dl_holds = IS_USED_LOCK('{key}') <=> {id}, \
           @dl_ours = @dl_minter <=> CONCAT('{prefix}', {id}); \
         SET @dl_break = (@dl_holds AND @dl_ours{fence}); \
         {kill}; \
         COMMIT; \
         SELECT @dl_break, @dl_got, @dl_exists, @dl_holds, @dl_ours",
        prefix = SESSION_OWNER_PREFIX,
        kill = kill_if_flagged(id)
    )
}

/// ` AND` the name's counter is `token` (nothing without one): the hold shown is the one there now,
/// not a later hold of the same session.
pub(crate) fn fence_is(table: &str, name: &str, token: Option<u64>) -> String {
    match token {
        Some(token) => format!(
            " AND (SELECT fence FROM {table} WHERE name = {}) <=> {token}",
            literal(name.as_bytes())
        ),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keep_case_and_fit() {
        assert_ne!(advisory_name("Name"), advisory_name("name"));
        assert_eq!(advisory_name("ü").len(), 63);
        assert!(advisory_name("x")
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b':'));
    }

    #[test]
    fn literals_are_hex() {
        assert_eq!(literal(b"a'b"), "X'612762'");
        assert_eq!(literal(b""), "X''");
    }
}
