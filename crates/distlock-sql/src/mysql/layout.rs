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
/// busy).
pub(crate) fn bump_fence_if_locked(table: &str, name: &str, key: &str) -> String {
    format!(
        "INSERT INTO {table} (name, fence) SELECT {}, LAST_INSERT_ID(1) FROM DUAL \
         WHERE IS_USED_LOCK('{key}') = CONNECTION_ID() \
         ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1)",
        literal(name.as_bytes())
    )
}

/// The counter of a name (`NULL`-free: no row → no result).
pub(crate) fn read_fence(table: &str, name: &str) -> String {
    format!(
        "SELECT fence FROM {table} WHERE name = {}",
        literal(name.as_bytes())
    )
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
