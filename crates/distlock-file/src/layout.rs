//! The on-disk layout, all of it: which file a lock name maps to, and what that file holds.
//!
//! Both are a compatibility contract: another distlock version (or another tool) that opens the same
//! directory must find the same file for the same name and read the same counter, so nothing here may
//! change without a new format number.
//!
//! # File names
//!
//! `<dir>/<escaped name>.lock`, where the escape keeps `A–Z a–z 0–9 _ -` and `.` (except a leading
//! `.`, so no lock file is hidden and `.`/`..` never appear) and writes every other byte of the UTF-8
//! name as `%XX` (upper-case hex). `/` becomes `%2F`, so a name never makes a subdirectory; `%` itself
//! becomes `%25`, so the escape is one-to-one. If the escaped name is longer than [`MAX_STEM`] bytes, its
//! first [`KEPT_PREFIX`] bytes are kept (never cutting an escape in half) and `~` plus the 16 hex digits
//! of [`fnv1a64`] of the whole name are appended: file names stay under the 255-byte limit of every
//! Linux file system. `~` is always escaped in names, so a hashed file name never equals an escaped one.
//!
//! ```
//! use distlock_file::layout::{file_name, fnv1a64};
//!
//! assert_eq!(file_name("orders/42"), "orders%2F42.lock");
//! assert_eq!(file_name("job.daily"), "job.daily.lock");
//! assert_eq!(file_name(".hidden"), "%2Ehidden.lock");
//! assert_eq!(file_name("größe 100%"), "gr%C3%B6%C3%9Fe%20100%25.lock");
//!
//! // Long names keep a prefix and a stable hash of the whole name.
//! let long = "x".repeat(1024);
//! assert_eq!(fnv1a64(long.as_bytes()), 0x51bf_c410_78b3_7325);
//! assert_eq!(file_name(&long), format!("{}~51bfc41078b37325.lock", "x".repeat(183)));
//! ```
//!
//! Two names that differ only in letter case map to different files, but on a case-insensitive file
//! system (macOS by default, or a Linux `casefold` directory) those files are the same, so the two names
//! share one lock.
//!
//! # File content
//!
//! A few lines of `key=value` text, rewritten whole at offset 0 by each holder while it holds the
//! `flock`. The file never shrinks: a record shorter than the one before it is followed by blank lines
//! up to the old length (a size change would make every `fdatasync` write the inode as well as the
//! data). Files written by earlier versions, cut to the record's length, read the same.
//!
//! ```text
//! # distlock lock file, format 1. Keep it: the fencing counter lives here.
//! token=42
//! owner=6f1c0d9e-…:3
//! pid=1234
//! host=build-7
//! since=1700000000123
//! end
//! ```
//!
//! `token` is the last fencing token minted for the name; `owner`, `pid`, `host` and `since` (Unix time
//! in milliseconds) describe the current holder and are removed at release, leaving the token line.
//! A `semaphore=1` line after `token` says the name is (or was) a semaphore (see [the other kinds'
//! files](self#the-other-kinds-files)); it is kept by every record written after it. Lines
//! starting with `#` and blank lines are comments; unknown keys are ignored (later formats may add some).
//! Values have `%`, and bytes below 0x20 or 0x7F, written as `%XX`. Reading stops at the `end` line:
//! what follows it (the padding, or the tail of a longer record an earlier version had not yet cut
//! when it crashed) is ignored, not mistaken for corruption. Only a zero-length file is fresh (token
//! 0); a file with any content but no readable `token` line before `end` (cut down to its header, only
//! blank lines, only unknown keys) is corrupt, and acquiring it fails with an error naming the file
//! rather than restart the counter (see [`Record::parse`]).
//!
//! The record says who holds the lock only while the lock file is `flock`ed: after a crash the last
//! holder's fields stay behind, which is why `status` tests the lock itself.
//!
//! # The other kinds' files
//!
//! Every file of a name is its stem (the escaped name above, `<stem>`) and a suffix:
//!
//! | file | what | held as |
//! |---|---|---|
//! | `<stem>.lock` | the mutex, and the read-write lock: the same lock, and the name's one fencing counter | mutex and writer `LOCK_EX`, reader `LOCK_SH` |
//! | `<stem>.writer` | the read-write lock's turnstile (empty) | `LOCK_EX` by a writer waiting behind readers; `LOCK_SH` by a reader while it takes its `LOCK_SH` on `<stem>.lock` |
//! | `<stem>.sem` | the semaphore's limit ([`SemaphoreLimit`]), written once and kept | never locked |
//! | `<stem>.sem.<i>` | slot `i` (0 to limit − 1) of the semaphore: permit `i` | `LOCK_EX` by the permit's holder, with a record like the lock file's (its token, owner, pid, host, since) |
//!
//! ```
//! use distlock_file::layout::{file_name, semaphore_file_name, slot_file_name, writer_file_name};
//!
//! let long = "x".repeat(1024);
//! let stem = file_name(&long).strip_suffix(".lock").unwrap().to_string();
//! assert_eq!(writer_file_name(&long), format!("{stem}.writer"));
//! assert_eq!(semaphore_file_name(&long), format!("{stem}.sem"));
//! assert_eq!(slot_file_name(&long, 1023), format!("{stem}.sem.1023"));
//! assert!(slot_file_name(&long, 1023).len() <= 255);
//! ```
//!
//! No file of one name is a file of another: lock files end in `.lock`, turnstiles in `.writer`,
//! limit files in `.sem` and slots in `.sem.` and digits, and a stem never holds `~` but as the start
//! of its hash. A permit's token is minted from `<stem>.lock`'s counter, under a brief `LOCK_EX` on it,
//! so tokens of every kind of one name come from one counter; the same write marks the lock file
//! `semaphore=1`, which tells a later mutex, writer or reader to look for held slots. Like lock files, these files are never
//! unlinked by distlock; the limit file is the one an operator removes (with no permit held) to change
//! a semaphore's limit.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The suffix of every lock file.
pub const SUFFIX: &str = ".lock";

/// The suffix of a read-write lock's turnstile file (see [the other kinds' files](self#the-other-kinds-files)).
pub const WRITER_SUFFIX: &str = ".writer";

/// The suffix of a semaphore's limit file; its slot files add `.<slot>`.
pub const SEMAPHORE_SUFFIX: &str = ".sem";

/// The most permits a semaphore may have on the file backend (the core allows more): every try of a
/// permit looks at up to this many slot files, and a waiter watches every one of them.
pub const MAX_SLOTS: u32 = 1024;

/// The comment written as the first line of every semaphore limit file.
pub const SEMAPHORE_HEADER: &str =
    "# distlock semaphore, format 1. The limit is kept: delete this file, with no permit held, to change it.";

/// The longest escaped name kept whole, in bytes. Longer ones are shortened with a hash.
pub const MAX_STEM: usize = 200;

/// How many bytes of a long escaped name are kept before `~` and the hash.
pub const KEPT_PREFIX: usize = MAX_STEM - 17;

/// The longest record a lock file may hold; anything larger is not a distlock lock file.
pub const MAX_RECORD_BYTES: usize = 4096;

/// The comment written as the first line of every record.
pub const HEADER: &str = "# distlock lock file, format 1. Keep it: the fencing counter lives here.";

/// FNV-1a, 64-bit: the hash that shortens long names.
///
/// It is written out here, not taken from a crate, because the file a name maps to must never change:
/// not across distlock versions, compilers, platforms or endianness. **Never change this function.**
///
/// ```
/// use distlock_file::layout::fnv1a64;
/// // The published FNV-1a test vectors.
/// assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
/// assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
/// assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
/// ```
pub const fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET_BASIS;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(PRIME);
        i += 1;
    }
    hash
}

/// The file name (no directory) of the lock file for `name`. See the [module docs](self).
pub fn file_name(name: &str) -> String {
    let mut out = Vec::with_capacity(name.len() + 8);
    push_file_name(&mut out, name);
    // Only ASCII was pushed.
    String::from_utf8(out).unwrap_or_default()
}

/// Appends [`file_name`]`(name)` to `out` (the lock file's path is built in one buffer: issue 9).
pub(crate) fn push_file_name(out: &mut Vec<u8>, name: &str) {
    push_stem(out, name);
    out.extend_from_slice(SUFFIX.as_bytes());
}

/// The name of the read-write lock's turnstile file of `name` (no directory): `<stem>.writer`, beside
/// the lock file `<stem>.lock`. See [the other kinds' files](self#the-other-kinds-files).
///
/// ```
/// use distlock_file::layout::writer_file_name;
/// assert_eq!(writer_file_name("orders/42"), "orders%2F42.writer");
/// ```
pub fn writer_file_name(name: &str) -> String {
    sibling_name(name, WRITER_SUFFIX)
}

/// The name of the semaphore's limit file of `name` (no directory): `<stem>.sem`.
///
/// ```
/// use distlock_file::layout::semaphore_file_name;
/// assert_eq!(semaphore_file_name("workers"), "workers.sem");
/// ```
pub fn semaphore_file_name(name: &str) -> String {
    sibling_name(name, SEMAPHORE_SUFFIX)
}

/// The name of slot `slot` (0-based: the permit's id) of the semaphore of `name` (no directory):
/// `<stem>.sem.<slot>`.
///
/// ```
/// use distlock_file::layout::slot_file_name;
/// assert_eq!(slot_file_name("workers", 0), "workers.sem.0");
/// assert_eq!(slot_file_name("a b", 12), "a%20b.sem.12");
/// ```
pub fn slot_file_name(name: &str, slot: u32) -> String {
    sibling_name(name, &format!("{SEMAPHORE_SUFFIX}.{slot}"))
}

fn sibling_name(name: &str, suffix: &str) -> String {
    let mut out = Vec::with_capacity(name.len() + 16);
    push_stem(&mut out, name);
    out.extend_from_slice(suffix.as_bytes());
    // Only ASCII was pushed.
    String::from_utf8(out).unwrap_or_default()
}

/// The path of a sibling of the lock file at `lock` (`<dir>/<stem>.lock`): the same stem with
/// `suffix` instead of [`SUFFIX`].
pub(crate) fn sibling_path(lock: &std::path::Path, suffix: &str) -> std::path::PathBuf {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let bytes = lock.as_os_str().as_bytes();
    let stem = bytes.strip_suffix(SUFFIX.as_bytes()).unwrap_or(bytes);
    let mut out = Vec::with_capacity(stem.len() + suffix.len());
    out.extend_from_slice(stem);
    out.extend_from_slice(suffix.as_bytes());
    std::path::PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// The path of slot `slot` of the semaphore whose lock file is `lock`.
pub(crate) fn slot_path(lock: &std::path::Path, slot: u32) -> std::path::PathBuf {
    sibling_path(lock, &format!("{SEMAPHORE_SUFFIX}.{slot}"))
}

/// Appends the escaped (and, if long, shortened) name: every file of `name` is this stem and a suffix.
fn push_stem(out: &mut Vec<u8>, name: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let start = out.len();
    for (i, &b) in name.as_bytes().iter().enumerate() {
        let keep = b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0);
        if keep {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[(b >> 4) as usize], HEX[(b & 0xF) as usize]]);
        }
    }
    if out.len() - start > MAX_STEM {
        // Cut before an escape that would straddle the limit: `%XX` is 3 bytes.
        let mut cut = start + KEPT_PREFIX;
        if let Some(pct) = out[cut - 2..cut].iter().rposition(|&b| b == b'%') {
            cut = cut - 2 + pct;
        }
        out.truncate(cut);
        out.push(b'~');
        let hash = fnv1a64(name.as_bytes());
        for shift in (0..16).rev() {
            out.push(HEX[((hash >> (shift * 4)) & 0xF) as usize].to_ascii_lowercase());
        }
    }
}

fn push_escape(out: &mut String, b: u8) {
    for c in escaped(b) {
        out.push(c as char);
    }
}

/// `b` as `%XX` (upper-case hex).
fn escaped(b: u8) -> [u8; 3] {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    [b'%', HEX[(b >> 4) as usize], HEX[(b & 0xF) as usize]]
}

/// What a lock file (or a semaphore's slot file) says: the name's fencing counter and, while someone
/// holds it, who (the `key=value` lines described in the module docs).
///
/// Reading one is how a tool outside distlock finds a name's last token and its (last) holder; a
/// release keeps the counter and drops the holder, so tokens never restart:
///
/// ```
/// # fn main() -> Result<(), String> {
/// use distlock_file::layout::{Record, HEADER};
///
/// let file = format!("{HEADER}\ntoken=42\nowner=6f1c:3\npid=1234\nhost=build-7\nend\n");
/// let record = Record::parse(file.as_bytes())?;
/// assert_eq!((record.token, record.pid), (42, Some(1234)));
/// assert!(record.has_holder());
///
/// let released = record.released_keeping(record.token);
/// assert_eq!(released.render(), format!("{HEADER}\ntoken=42\nend\n"));
/// assert!(!released.has_holder());
/// // Content with no token line has lost its counter: corrupt, never read as a fresh 0.
/// assert!(Record::parse(b"owner=6f1c:3\n").is_err());
/// # Ok(()) }
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    /// The last fencing token minted for the name (0: none yet).
    pub token: u64,
    /// The holder's owner id.
    pub owner: Option<String>,
    /// The holder's process id (in its pid namespace).
    pub pid: Option<u32>,
    /// The holder's host name.
    pub host: Option<String>,
    /// When the hold began, in milliseconds since the Unix epoch.
    pub since_ms: Option<u64>,
    /// The name is (or was) a semaphore: a mutex, writer or reader that takes the lock file must
    /// look for held permits first. Written by the first permit's grant and kept by every later
    /// record (line `semaphore=1`).
    pub semaphore: bool,
}

impl Record {
    /// A record with only the counter: what a released lock file holds.
    pub fn released(token: u64) -> Self {
        Self {
            token,
            ..Self::default()
        }
    }

    /// The released record that keeps `self`'s counter and its `semaphore` mark.
    pub fn released_keeping(&self, token: u64) -> Self {
        Self {
            token,
            semaphore: self.semaphore,
            ..Self::default()
        }
    }

    /// Whether the record names a holder.
    pub fn has_holder(&self) -> bool {
        self.owner.is_some() || self.pid.is_some() || self.host.is_some() || self.since_ms.is_some()
    }

    /// When the hold began, if recorded.
    pub fn since(&self) -> Option<SystemTime> {
        self.since_ms
            .and_then(|ms| UNIX_EPOCH.checked_add(Duration::from_millis(ms)))
    }

    /// The file content for this record.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(160);
        out.push_str(HEADER);
        let _ = write!(out, "\ntoken={}\n", self.token);
        if self.semaphore {
            out.push_str("semaphore=1\n");
        }
        if let Some(owner) = &self.owner {
            out.push_str("owner=");
            push_escaped_value(&mut out, owner);
            out.push('\n');
        }
        if let Some(pid) = self.pid {
            let _ = writeln!(out, "pid={pid}");
        }
        if let Some(host) = &self.host {
            out.push_str("host=");
            push_escaped_value(&mut out, host);
            out.push('\n');
        }
        if let Some(since) = self.since_ms {
            let _ = writeln!(out, "since={since}");
        }
        out.push_str("end\n");
        out
    }

    /// Reads a lock file's content.
    ///
    /// Empty content (a zero-length file) is a fresh file: token 0, no holder. Any other content with
    /// no `token` line (blank lines only, the header only, unknown fields only), a
    /// `token` that is not a number, two `token` lines, or bytes that are not UTF-8 is corrupt: the counter
    /// cannot be trusted, and restarting it would hand out tokens a resource has already seen. Holder
    /// fields that do not parse are dropped (they are only shown by `status`).
    pub fn parse(content: &[u8]) -> Result<Self, String> {
        if content.is_empty() {
            return Ok(Record::default());
        }
        if let Some(token) = released_token(content) {
            return Ok(Record::released(token));
        }
        let text =
            std::str::from_utf8(content).map_err(|_| "the file is not UTF-8 text".to_string())?;
        let mut record = Record::default();
        let mut token = None;
        for line in text.lines() {
            let line = line.trim_end_matches('\r');
            if line == "end" {
                break;
            }
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                return Err(format!("line {line:?} is not key=value"));
            };
            match key {
                "token" => {
                    if token.is_some() {
                        return Err("it has two token lines".into());
                    }
                    let value: u64 = value
                        .parse()
                        .map_err(|_| format!("the token {value:?} is not a number"))?;
                    token = Some(value);
                }
                "owner" => record.owner = Some(unescape_value(value)),
                "pid" => record.pid = value.parse().ok(),
                "host" => record.host = Some(unescape_value(value)),
                "since" => record.since_ms = value.parse().ok(),
                "semaphore" => record.semaphore = value == "1",
                _ => {}
            }
        }
        // Only a zero-length file is fresh: a file with content but no token line (cut down to its
        // header, only blank lines, only fields this version does not know) has lost its counter,
        // and reading it as 0 would hand out token 1 again.
        let token = token.ok_or_else(|| "it has no token line".to_string())?;
        record.token = token;
        Ok(record)
    }
}

/// A semaphore's limit file: the number of permits, written once by the first user and kept.
///
/// ```
/// use distlock_file::layout::{SemaphoreLimit, SEMAPHORE_HEADER};
///
/// let text = SemaphoreLimit::render(4);
/// assert_eq!(text, format!("{SEMAPHORE_HEADER}\nlimit=4\nend\n"));
/// assert_eq!(SemaphoreLimit::parse(text.as_bytes()), Ok(4));
/// assert!(SemaphoreLimit::parse(b"limit=0\nend\n").is_err());
/// assert!(SemaphoreLimit::parse(b"").is_err());
/// ```
#[derive(Debug)]
pub struct SemaphoreLimit;

impl SemaphoreLimit {
    /// The file content for a semaphore of `limit` permits.
    pub fn render(limit: u32) -> String {
        format!("{SEMAPHORE_HEADER}\nlimit={limit}\nend\n")
    }

    /// Reads a limit file: the `limit` line (1 to [`MAX_SLOTS`]) before `end`; comments, blank lines and
    /// unknown keys are skipped. Anything else (no limit, two, one out of range, not UTF-8, an empty
    /// file) is refused with what is wrong: the file is written whole before it is linked into place,
    /// so a reader never sees it half-written.
    pub fn parse(content: &[u8]) -> Result<u32, String> {
        let text =
            std::str::from_utf8(content).map_err(|_| "the file is not UTF-8 text".to_string())?;
        let mut limit = None;
        for line in text.lines() {
            let line = line.trim_end_matches('\r');
            if line == "end" {
                break;
            }
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                return Err(format!("line {line:?} is not key=value"));
            };
            if key == "limit" {
                if limit.is_some() {
                    return Err("it has two limit lines".into());
                }
                let value: u32 = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_SLOTS).contains(n))
                    .ok_or_else(|| {
                        format!("the limit {value:?} is not a number from 1 to {MAX_SLOTS}")
                    })?;
                limit = Some(value);
            }
        }
        limit.ok_or_else(|| "it has no limit line".to_string())
    }
}

/// Escapes `%` and control bytes so a value stays on its line.
/// The token of a released record exactly as [`Record::render`] writes it (the header, the token
/// line, `end`, then anything: the padding), read without the general parser: it is what every
/// acquire finds (issue 9). `None` for anything else, which the general parser reads.
fn released_token(content: &[u8]) -> Option<u64> {
    let rest = content.strip_prefix(HEADER.as_bytes())?;
    let rest = rest.strip_prefix(b"\ntoken=")?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let tail = rest[digits..].strip_prefix(b"\nend\n")?;
    // The parser refuses content that is not UTF-8 anywhere, past `end` too.
    std::str::from_utf8(tail).ok()?;
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

/// Appends `value` with `%`, and bytes below 0x20 or 0x7F, written as `%XX`; the rest as is, in runs.
fn push_escaped_value(out: &mut String, value: &str) {
    let mut rest = value;
    while let Some(at) = rest.bytes().position(value_byte_needs_escape) {
        out.push_str(&rest[..at]);
        push_escape(out, rest.as_bytes()[at]);
        rest = &rest[at + 1..];
    }
    out.push_str(rest);
}

/// The rule of [`push_escaped_value`]: `%` and the control bytes.
fn value_byte_needs_escape(b: u8) -> bool {
    b == b'%' || b < 0x20 || b == 0x7F
}

/// Where the owner id starts in a record `render` made (after `owner=`); `None` without one.
pub(crate) fn owner_offset(record: &[u8]) -> Option<usize> {
    const FIELD: &[u8] = b"\nowner=";
    // The header and the token line before it hold no such line.
    record
        .windows(FIELD.len())
        .position(|w| w == FIELD)
        .map(|at| at + FIELD.len())
}

/// Whether `record` has the owner id `owner` at `at` (as [`owner_offset`] found it): its escaped form
/// there, ending the line.
pub(crate) fn names_owner_at(record: &[u8], at: usize, owner: &str) -> bool {
    let Some(mut rest) = record.get(at..) else {
        return false;
    };
    // Escaped on the fly by the one rule `render` used, so a release allocates nothing here.
    for b in owner.bytes() {
        let next = if value_byte_needs_escape(b) {
            rest.strip_prefix(&escaped(b)[..])
        } else {
            rest.strip_prefix(&[b][..])
        };
        match next {
            Some(tail) => rest = tail,
            None => return false,
        }
    }
    rest.first() == Some(&b'\n')
}

fn unescape_value(value: &str) -> String {
    distlock_core::url::percent_decode(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_owner_at_matches_the_rendered_owner_only() {
        let owners = [
            "plain:1",
            "a%b",
            "tab\there",
            "nl\nx",
            "del\u{7f}",
            "ü:%0A",
            "",
        ];
        for owner in owners {
            let record = Record {
                token: 7,
                owner: Some(owner.to_string()),
                pid: Some(1),
                ..Record::default()
            }
            .render();
            let at = owner_offset(record.as_bytes()).expect("an owner line");
            assert!(names_owner_at(record.as_bytes(), at, owner), "{owner:?}");
            for other in owners.iter().filter(|o| **o != owner) {
                assert!(
                    !names_owner_at(record.as_bytes(), at, other),
                    "{owner:?} read as {other:?}"
                );
            }
            // A prefix, or the owner with more after it, is another owner.
            assert!(!names_owner_at(record.as_bytes(), at, &format!("{owner}x")));
            if let Some((shorter, _)) = owner.char_indices().last().map(|(i, c)| (&owner[..i], c)) {
                assert!(!names_owner_at(record.as_bytes(), at, shorter), "{owner:?}");
            }
        }
    }

    #[test]
    fn escape_is_one_to_one_on_tricky_names() {
        let names = [
            "a/b", "a%2Fb", "a~b", ".", "..", "a.", "-", "_", " ", "ü", "u\u{308}",
        ];
        let files: std::collections::HashSet<_> = names.iter().map(|n| file_name(n)).collect();
        assert_eq!(files.len(), names.len());
        for f in &files {
            assert!(!f.contains('/'));
            assert!(!f.starts_with('.'));
        }
    }

    #[test]
    fn long_names_never_cut_an_escape_and_stay_short() {
        for pad in 0..4 {
            let name = format!("{}{}", "a".repeat(180 + pad), "/".repeat(100));
            let file = file_name(&name);
            let stem = file.strip_suffix(SUFFIX).unwrap();
            let (prefix, hash) = stem.split_once('~').unwrap();
            assert_eq!(hash.len(), 16);
            assert!(prefix.len() <= KEPT_PREFIX);
            assert!(prefix.len() > KEPT_PREFIX - 3);
            // The last `%` of the prefix starts a whole escape.
            if let Some(pct) = prefix.rfind('%') {
                assert!(pct + 3 <= prefix.len(), "cut escape in {prefix}");
            }
            assert!(file.len() <= 255);
        }
        // Exactly at the limit: kept whole.
        let edge = "b".repeat(MAX_STEM);
        assert_eq!(file_name(&edge), format!("{edge}.lock"));
        assert!(file_name(&"b".repeat(MAX_STEM + 1)).contains('~'));
    }

    #[test]
    fn values_with_newlines_round_trip() {
        let mut record = Record::released(7);
        record.owner = Some("evil\nowner=x%".into());
        let parsed = Record::parse(record.render().as_bytes()).unwrap();
        assert_eq!(parsed, record);
    }

    /// The rendered record, byte for byte (format 1 is a compatibility contract): `%`, control bytes
    /// and DEL escaped, everything else (UTF-8 included) as is.
    #[test]
    fn the_record_renders_exactly() {
        let mut record = Record::released(42);
        record.owner = Some("größe%\u{7f}\tx:3".into());
        record.pid = Some(1234);
        record.host = Some("build-7\r".into());
        record.since_ms = Some(1_700_000_000_123);
        assert_eq!(
            record.render(),
            format!(
                "{HEADER}\ntoken=42\nowner=größe%25%7F%09x:3\npid=1234\nhost=build-7%0D\nsince=1700000000123\nend\n"
            )
        );
        assert_eq!(Record::parse(record.render().as_bytes()).unwrap(), record);
        assert_eq!(
            Record::released(0).render(),
            format!("{HEADER}\ntoken=0\nend\n")
        );
    }

    /// The semaphore mark renders after the token, reads back, and survives a release.
    #[test]
    fn the_semaphore_mark_round_trips() {
        let mut record = Record::released(5);
        record.semaphore = true;
        assert_eq!(
            record.render(),
            format!("{HEADER}\ntoken=5\nsemaphore=1\nend\n")
        );
        assert_eq!(Record::parse(record.render().as_bytes()).unwrap(), record);
        record.owner = Some("o".into());
        assert_eq!(record.released_keeping(6), {
            let mut kept = Record::released(6);
            kept.semaphore = true;
            kept
        });
        assert!(
            !Record::parse(Record::released(5).render().as_bytes())
                .unwrap()
                .semaphore
        );
    }

    /// A released record is read the same with and without the short path, and content it does not
    /// take (other fields, other spelling, a torn tail, a token that overflows) still goes to the
    /// general parser.
    #[test]
    fn the_released_short_path_reads_what_the_parser_reads() {
        let padded = format!("{HEADER}\ntoken=9\nend\n\n\n\n");
        let tail = format!("{HEADER}\ntoken=9\nend\nowner=x\nbroken");
        assert_eq!(released_token(padded.as_bytes()), Some(9));
        assert_eq!(released_token(tail.as_bytes()), Some(9));
        assert_eq!(
            Record::parse(padded.as_bytes()).unwrap(),
            Record::released(9)
        );
        for content in [
            format!("{HEADER}\ntoken=18446744073709551616\nend\n"),
            format!("{HEADER}\ntoken=\nend\n"),
            format!("{HEADER}\ntoken=+9\nend\n"),
            format!("{HEADER}\ntoken=9\nowner=me\nend\n"),
            format!("{HEADER}\ntoken=9\r\nend\n"),
            format!("{HEADER}\ntoken=9"),
            format!("{HEADER}\ntoken=9\nend"),
            "token=9\nend\n".to_string(),
        ] {
            assert_eq!(released_token(content.as_bytes()), None, "{content:?}");
        }
        let not_utf8 = [format!("{HEADER}\ntoken=9\nend\n").as_bytes(), b"\xff"].concat();
        assert_eq!(released_token(&not_utf8), None);
        assert!(Record::parse(&not_utf8).is_err());
        for token in [0, 1, 42, u64::MAX] {
            let rendered = Record::released(token).render();
            assert_eq!(released_token(rendered.as_bytes()), Some(token));
        }
    }

    #[test]
    fn corrupt_content_is_refused() {
        for bad in [
            &b"token=x\n"[..],
            b"token=1\ntoken=2\n",
            b"owner=a\n",
            b"\0\0\0\0",
            b"\xff",
        ] {
            assert!(Record::parse(bad).is_err(), "{bad:?}");
        }
        // Only a zero-length file is fresh: blank lines, the header alone or unknown keys alone
        // have lost the counter.
        assert_eq!(Record::parse(b"").unwrap(), Record::released(0));
        for no_token in [
            &b"\n  \n"[..],
            HEADER.as_bytes(),
            format!("{HEADER}\nend\n").as_bytes(),
            b"future=1\n",
            b"end\ntoken=3\n",
        ] {
            assert!(Record::parse(no_token).is_err(), "{no_token:?}");
        }
        assert_eq!(
            Record::parse(b"token=3\nfuture=1\n").unwrap(),
            Record::released(3)
        );
        // A torn tail after `end` is ignored.
        assert_eq!(
            Record::parse(b"token=3\nend\nner=x:1\npid=12").unwrap(),
            Record::released(3)
        );
    }
}
