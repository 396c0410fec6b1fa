//! The on-server layout, all of it: the same keys and transactions as etcd's Go
//! `client/v3/concurrency.Mutex` and `etcdctl lock NAME`, so distlock, Go services and `etcdctl lock`
//! exclude each other on the same name.
//!
//! * **Prefix.** Lock `NAME` lives under the prefix `NAME/` (Go: `NewMutex(s, pfx)` uses `pfx + "/"`;
//!   `etcdctl lock NAME` passes `NAME`). The name is used raw, no escaping.
//! * **Key.** Each contender's key is `NAME/<session lease id in lowercase hex>` (Go:
//!   `fmt.Sprintf("%s%x", pfx, s.Lease())`), attached to that lease, created in a transaction only if
//!   absent (`create_revision == 0`). distlock stores the owner id as the value (Go stores `""` and never
//!   reads it), so `distlock status` can name the holder, and so that a key is adopted (after a lost
//!   reply) only by the owner that wrote it.
//! * **One key per contender, also within one session.** All locks of a backend (and of its clones)
//!   share the session lease, so two owners of one name in one process would both compute
//!   `NAME/<lease hex>` (Go's Mutexes on one session do, and then both "hold" it). distlock's backend
//!   claims a key locally before using it: the first contender of a name on a session uses Go's
//!   `NAME/<lease hex>`, a second one at the same time `NAME/<lease hex>_<n>` ([`slot_key`]). Every key
//!   under `NAME/` is a contender to Go and to `etcdctl lock` (they order by create_revision and never
//!   parse keys), so the extra keys queue fairly with everyone.
//! * **Contenders.** A contender of `NAME` is a key `NAME/<hex>` or `NAME/<hex>_<digits>` ([`is_contender`]):
//!   lowercase hex (a lease id as Go prints it), no further `/`. Everything else under the prefix is
//!   not `NAME`'s: chiefly the keys of locks nested under the name (`NAME/b/<lease hex>` of lock
//!   `NAME/b`; `NAME/abc/<lease hex>` starts with hex digits too, so no key range tells them apart, only
//!   the key's shape does), also an operator's stray key. distlock passes them over wherever it reads
//!   the prefix: the holder, the predecessor and `status`. The handoff's range compare cannot tell them
//!   apart and errs on the safe side ([`hand_off_txn`]).
//! * **Holder.** The contender with the smallest create_revision under `NAME/`. Waiters are served in
//!   the order their keys were created (FIFO). The reads ask for the oldest key (and the newest one below
//!   the own key) with `limit: 1`, as Go does; only when such an answer is not a contender is the prefix
//!   read again ([`keys_up_to`]), at the revision of the first read so both are one view, and filtered.
//! * **Token.** The holder key's create_revision: a deleted key never comes back with its old revision,
//!   and the lock always goes to the oldest live contender, so it strictly increases from holder to
//!   holder.
//! * **Waiting.** A waiter watches only the contender just before its own (the largest create_revision
//!   below its own), from the revision of the read that found it + 1: a watch that starts at or below
//!   the store's current revision is an "unsynced" watcher that etcd serves from a 100 ms loop, which is
//!   the handoff stall measured with etcd's server-side Lock RPC.
//! * **Release.** Delete the own key only if its create_revision is still the one acquired (Go deletes
//!   unconditionally, so a retried Unlock can delete a newer holder's key: etcd issue 22082).
//! * **Break** (`distlock break NAME`, an operator ending a dead holder's hold). Delete the holder's
//!   key (the oldest contender: a mutex's or a writer's) in a txn whose compare pins it to the hold
//!   `status` showed: its create_revision is the token shown and, when an owner id is shown, its value
//!   is that owner ([`break_txn`]). A key never comes back with an old create_revision and no key
//!   older than the holder's can appear, so a key passing the compare is still the holder; a holder
//!   that came since is never touched. The holder's session lease is not revoked (its other locks
//!   live on); a broken writer's token is recorded as its release would ([`write_release_txn`]).
//!   Waiters and the broken holder watch the key, so both learn of the delete as of a release.
//!   `status` shows each holder's key kind and create_revision as its hold id ([`hold_id`]): a break
//!   aimed at a reader or a permit is refused, one aimed at an exclusive holder that has gone finds
//!   nothing to delete, whoever holds now.
//!
//! **Nested names** (issue 24). The prefix of `a` is `a/`, which also covers the keys of lock `a/b`
//! (`a/b/<lease hex>`). distlock's `a` and `a/b` never block each other: only contenders count, and
//! `status a` never shows `a/b`'s keys. **What a Go client sees:** a Go `concurrency.Mutex` or
//! `etcdctl lock` on `a` counts every key under `a/` (it reads the oldest key and waits for the newest
//! one below its own, never parsing keys), so a hold of `a/b` — by distlock or by Go — whose key is
//! older than the Go client's blocks it until that key is deleted (the nested hold ends or its lease
//! runs out), and it may watch a nested key as its predecessor. Its own key `a/<lease hex>` is a
//! contender of `a` to distlock all the same: while it waits only behind nested keys, distlock sees it
//! as `a`'s holder, so distlock's acquirers of `a` queue behind it and `status a` names it (no owner:
//! Go writes an empty value). Exclusion on one name is unchanged either way: a Go holder's key is the
//! oldest of all keys under `a/`, hence the oldest contender; a distlock holder's is the oldest
//! contender, so every Go key of `a` is newer. A Go client on `a/b` reads only `a/b/` and is never
//! blocked by `a`. One cycle stays possible through Go's rule: a process holding `a/b` while it acquires
//! `a` waits for a Go client of `a` queued after its `a/b` key, which waits for that `a/b` key.
//!
//! **Lock kinds** (issue 25). Under the same prefix: readers `NAME/read/<unix nanos>` and writers
//! `NAME/write/<unix nanos>` ([`read_key`], [`write_key`]: Go's `recipe.RWMutex`), permits
//! `NAME/permit.<lease hex>.<n>` ([`permit_key`]: distlock's own), all on the session lease with the
//! owner id as the value. [`classify`] tells the four kinds apart by shape; they form one queue by
//! create_revision (a mutex or writer waits for every older key of the name, a reader for older
//! mutex, writer and permit keys, a permit for older keys of other kinds and for a free permit).
//! A permit's token is minted at its grant: the revision of a put of its own key in the txn that
//! decides the grant ([`permit_grant_txn`]; permits freed together may be granted newest first).
//! Outside every prefix (no `/` in them, the name escaped): the semaphore's kept limit
//! ([`limit_key`]) and the last released write's token that readers carry ([`write_record_key`]).
//!
//! ```
//! use distlock_etcd::layout;
//! assert_eq!(layout::prefix("orders/42"), "orders/42/");
//! assert_eq!(layout::key("orders/42", 0x694d_7d5a_0c1f_2a0b), "orders/42/694d7d5a0c1f2a0b");
//! assert_eq!(layout::key("x", 0x1a), "x/1a"); // no padding, as Go's %x
//! ```

use crate::rpc::pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use crate::rpc::pb::etcdserverpb::range_request::{SortOrder, SortTarget};
use crate::rpc::pb::etcdserverpb::{
    request_op, Compare, DeleteRangeRequest, PutRequest, RangeRequest, RequestOp, TxnRequest,
};

/// The prefix every key of lock `name` lives under: `name/`.
pub fn prefix(name: &str) -> String {
    format!("{name}/")
}

/// The key of the contender holding session lease `lease` on lock `name`: `name/<lease hex>`.
pub fn key(name: &str, lease: i64) -> String {
    format!("{name}/{lease:x}")
}

/// The key of the `slot`-th concurrent local contender on session lease `lease`: slot 0 is Go's
/// `name/<lease hex>`, slot n > 0 is `name/<lease hex>_<n>` (`_` is not a hex digit, so it never equals
/// another lease's key).
///
/// ```
/// use distlock_etcd::layout;
/// assert_eq!(layout::slot_key("x", 0x1a, 0), layout::key("x", 0x1a));
/// assert_eq!(layout::slot_key("x", 0x1a, 2), "x/1a_2");
/// ```
pub fn slot_key(name: &str, lease: i64, slot: usize) -> String {
    if slot == 0 {
        key(name, lease)
    } else {
        format!("{name}/{lease:x}_{slot}")
    }
}

/// The most hex digits a session lease id has in a key (an `i64` printed with Go's `%x`): a longer
/// segment is no mutex contender. Readers' and writers' keys carry unix nanoseconds, at least
/// [`NANOS_DIGITS`] digits, so the two shapes never meet: a lock `NAME/read` (`NAME/write`) and the
/// read-write lock `NAME` do not count each other's keys (which made a process holding `NAME`'s read
/// lock wait for itself when it took the mutex `NAME/read`).
///
/// ```
/// use distlock_etcd::layout::{self, classify, is_contender, NameKey};
/// let (x, x_read) = (layout::prefix("X"), layout::prefix("X/read"));
/// let reader = layout::read_key("X", 1_733_540_000_123_456_789);
/// assert_eq!(classify(&x, reader.as_bytes()), Some(NameKey::Read));
/// assert!(!is_contender(&x_read, reader.as_bytes())); // 19 digits: no lease id
/// let go_mutex = layout::key("X/read", 0x1234); // a lease id printing as digits only
/// assert!(is_contender(&x_read, go_mutex.as_bytes()));
/// assert_eq!(classify(&x, go_mutex.as_bytes()), None); // 4 digits: no unix nanos
/// assert!(is_contender(&x_read, layout::key("X/read", i64::MAX).as_bytes()));
/// ```
pub const LEASE_HEX_DIGITS: usize = 16;

/// The fewest digits of the unix nanoseconds in a reader's or writer's key (Go's `time.Now().UnixNano()`
/// has had 19 since 2001): more than [`LEASE_HEX_DIGITS`], so no lease id is taken for them.
pub const NANOS_DIGITS: usize = 17;

/// Whether `key` is a contender of the lock whose prefix is `prefix` (`NAME/`): the prefix followed by
/// lowercase hex digits (a session lease id as Go's `%x` prints it, at most [`LEASE_HEX_DIGITS`]) and, for distlock's slot keys
/// ([`slot_key`]), `_` and decimal digits; nothing else, in particular no further `/`. The keys of a lock
/// nested under the name (`NAME/b/<lease hex>`, also `NAME/abc/<lease hex>`, whose segment is hex) are not
/// contenders, nor is any other key under the prefix.
///
/// ```
/// use distlock_etcd::layout::{is_contender, key, prefix, slot_key};
/// let n = prefix("N");
/// assert!(is_contender(&n, key("N", 0x694d_7d5a_0c1f_2a0b).as_bytes())); // Go's and distlock's key
/// assert!(is_contender(&n, slot_key("N", 0x1a, 3).as_bytes())); // a second local owner's
/// // Keys of locks nested under N: N/b, N/abc (hex!), N/0, N/-x, N/ a, and deeper.
/// for nested in ["b", "abc", "0", "-x", " a", "b/c"] {
///     let lock = format!("N/{nested}");
///     assert!(!is_contender(&n, key(&lock, 0x1a).as_bytes()), "{nested}");
///     assert!(!is_contender(&n, slot_key(&lock, 0x1a, 2).as_bytes()), "{nested}");
/// }
/// // Anything else: not hex, upper case, an empty or malformed slot, another name's key.
/// for other in ["N/", "N/x", "N/1A", "N/1a_", "N/1a_x", "N/_1", "N/1a_2_3", "N/1a ", "M/1a", "N1a"] {
///     assert!(!is_contender(&n, other.as_bytes()), "{other}");
/// }
/// ```
pub fn is_contender(prefix: &str, key: &[u8]) -> bool {
    let Some(rest) = key.strip_prefix(prefix.as_bytes()) else {
        return false;
    };
    let (hex, slot) = match rest.iter().position(|&b| b == b'_') {
        Some(at) => (&rest[..at], Some(&rest[at + 1..])),
        None => (rest, None),
    };
    let is_hex = |b: &u8| b.is_ascii_digit() || (b'a'..=b'f').contains(b);
    !hex.is_empty()
        && hex.len() <= LEASE_HEX_DIGITS
        && hex.iter().all(is_hex)
        && slot.is_none_or(|digits| !digits.is_empty() && digits.iter().all(u8::is_ascii_digit))
}

/// What a key of a name is, by its shape ([`classify`]): the four kinds share the name's prefix and
/// one queue ordered by create_revision.
///
/// A reader of the name's keys (a `status`, a tool of its own) sorts them by kind to tell who
/// excludes whom; keys of other locks under the prefix are `None`:
///
/// ```
/// use distlock_etcd::layout::{self, classify, NameKey};
///
/// let prefix = layout::prefix("jobs");
/// let writer = layout::write_key("jobs", 1_733_540_000_123_456_789);
/// let kind = classify(&prefix, writer.as_bytes()).expect("a key of `jobs`");
/// assert_eq!(kind, NameKey::Write);
/// assert!(kind.is_exclusive()); // as a mutex: no reader, no permit, no other writer
/// let reader = layout::read_key("jobs", 1_733_540_000_123_456_790);
/// assert!(!classify(&prefix, reader.as_bytes()).is_some_and(NameKey::is_exclusive));
/// assert_eq!(classify(&prefix, layout::key("jobs/nested", 0x1a).as_bytes()), None);
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NameKey {
    /// A mutex contender, `NAME/<lease hex>` or `NAME/<lease hex>_<n>` ([`is_contender`]): Go's
    /// `concurrency.Mutex`, `etcdctl lock`, distlock's mutex.
    Mutex,
    /// A reader, `NAME/read/<unix nanos>` ([`read_key`], Go's `recipe.RWMutex`).
    Read,
    /// A writer, `NAME/write/<unix nanos>` ([`write_key`], Go's `recipe.RWMutex`).
    Write,
    /// A semaphore permit, `NAME/permit.<lease hex>.<n>` ([`permit_key`], distlock's own).
    Permit,
}

impl NameKey {
    /// Excludes everyone: a mutex or a writer.
    pub fn is_exclusive(self) -> bool {
        matches!(self, NameKey::Mutex | NameKey::Write)
    }

    /// The word for the kind in a [`hold_id`]: `mutex`, `read`, `write`, `permit`.
    fn tag(self) -> &'static str {
        match self {
            NameKey::Mutex => "mutex",
            NameKey::Read => "read",
            NameKey::Write => "write",
            NameKey::Permit => "permit",
        }
    }
}

/// The hold id `status` shows for a holder (`HolderInfo::hold_id`): its key's kind and
/// create_revision, `<kind>@<revision>`. The revision is the key's own (a reader's or a permit's token
/// is not), so it names one hold of one key, and the kind tells a break whether it was aimed at an
/// exclusive holder ([`parse_hold_id`]).
///
/// ```
/// use distlock_etcd::layout::{hold_id, parse_hold_id, NameKey};
/// assert_eq!(hold_id(NameKey::Write, 42), "write@42");
/// assert_eq!(parse_hold_id("write@42"), Some((NameKey::Write, 42)));
/// assert_eq!(parse_hold_id(&hold_id(NameKey::Read, 7)), Some((NameKey::Read, 7)));
/// for other in ["", "write", "write@", "write@x", "lock@42", "42", "write@-1"] {
///     assert_eq!(parse_hold_id(other), None, "{other:?}");
/// }
/// ```
pub fn hold_id(kind: NameKey, create_revision: i64) -> String {
    format!("{}@{create_revision}", kind.tag())
}

/// A [`hold_id`]'s kind and create_revision; `None` for anything else (another engine's id).
pub fn parse_hold_id(id: &str) -> Option<(NameKey, i64)> {
    let (tag, rev) = id.split_once('@')?;
    let kind = [
        NameKey::Mutex,
        NameKey::Read,
        NameKey::Write,
        NameKey::Permit,
    ]
    .into_iter()
    .find(|k| k.tag() == tag)?;
    let rev: i64 = rev.parse().ok()?;
    (rev > 0).then_some((kind, rev))
}

/// The key of a reader of the read-write lock `name`: `name/read/<unix nanos>`, Go's
/// `recipe.RWMutex` (`newUniqueEphemeralKey(s, pfx + "/read")`: `fmt.Sprintf("%s/%v", prefix,
/// time.Now().UnixNano())`).
///
/// ```
/// use distlock_etcd::layout;
/// assert_eq!(layout::read_key("orders/42", 1_733_540_000_123_456_789), "orders/42/read/1733540000123456789");
/// assert_eq!(layout::write_key("orders/42", 7), "orders/42/write/7");
/// ```
pub fn read_key(name: &str, unix_nanos: u128) -> String {
    format!("{name}/read/{unix_nanos}")
}

/// The key of a writer of the read-write lock `name`: `name/write/<unix nanos>` (Go's `recipe.RWMutex`).
pub fn write_key(name: &str, unix_nanos: u128) -> String {
    format!("{name}/write/{unix_nanos}")
}

/// The key of the `slot`-th permit of semaphore `name` on session lease `lease`:
/// `name/permit.<lease hex>.<slot>` (distlock's own layout: there is no Go recipe). Directly under the
/// name's prefix with no further `/`, so no lock nested under the name ever sees it, while a Go
/// `concurrency.Mutex` or `etcdctl lock` on the name waits for it as for any key under `name/`. The
/// permit's name (`LockGuard::permit`, `DISTLOCK_PERMIT`) is the part after `name/`.
///
/// ```
/// use distlock_etcd::layout::{self, classify, NameKey};
/// assert_eq!(layout::permit_key("jobs", 0x1a, 0), "jobs/permit.1a.0");
/// assert_eq!(layout::permit_name("jobs", "jobs/permit.1a.3"), "permit.1a.3");
/// let p = layout::prefix("jobs");
/// assert_eq!(classify(&p, b"jobs/permit.1a.3"), Some(NameKey::Permit));
/// assert_eq!(classify(&p, b"jobs/1a"), Some(NameKey::Mutex));
/// assert_eq!(classify(&p, b"jobs/1a_2"), Some(NameKey::Mutex));
/// assert_eq!(classify(&p, b"jobs/read/1733540000123456789"), Some(NameKey::Read));
/// assert_eq!(classify(&p, b"jobs/write/1733540000123456789"), Some(NameKey::Write));
/// // Not the name's: nested locks' keys, malformed shapes, another name.
/// for other in ["jobs/b/1a", "jobs/read/", "jobs/read/1a", "jobs/read/1/2", "jobs/write/x", "jobs/permit.1a",
///               "jobs/permit.1a.", "jobs/permit.xy.0", "jobs/permit.1a.0/1a", "jobs/readers", "job/1a",
///               "jobs/read/1234", "jobs/write/7"] { // too short for unix nanos: a lease id
///                                                   // of a lock `jobs/read`, `jobs/write`
///     assert_eq!(classify(&p, other.as_bytes()), None, "{other}");
/// }
/// ```
pub fn permit_key(name: &str, lease: i64, slot: usize) -> String {
    format!("{name}/permit.{lease:x}.{slot}")
}

/// The permit's name, for `LockGuard::permit` and `status`: the key without the name's prefix.
pub fn permit_name<'a>(name: &str, key: &'a str) -> &'a str {
    key.strip_prefix(&prefix(name)).unwrap_or(key)
}

/// The key range (start, end) of every permit of semaphore `name` (the keys starting with
/// `name/permit.`), which a permit waiting for a free permit watches for deletes.
pub fn permit_range(name: &str) -> (Vec<u8>, Vec<u8>) {
    let start = format!("{name}/permit.").into_bytes();
    let end = prefix_end(&start);
    (start, end)
}

/// What `key` is to the name whose prefix is `prefix` (`NAME/`), by its shape: one of the four kinds,
/// or `None` for anything else under the prefix (a nested lock's keys, a stray key). See [`permit_key`]
/// for examples.
pub fn classify(prefix: &str, key: &[u8]) -> Option<NameKey> {
    if is_contender(prefix, key) {
        return Some(NameKey::Mutex);
    }
    let rest = key.strip_prefix(prefix.as_bytes())?;
    let digits = |d: &[u8]| !d.is_empty() && d.iter().all(u8::is_ascii_digit);
    // Unix nanoseconds, never a lease id (a nested lock `NAME/read`'s key): see [`NANOS_DIGITS`].
    let nanos = |d: &[u8]| d.len() >= NANOS_DIGITS && digits(d);
    if let Some(n) = rest.strip_prefix(b"read/") {
        return nanos(n).then_some(NameKey::Read);
    }
    if let Some(n) = rest.strip_prefix(b"write/") {
        return nanos(n).then_some(NameKey::Write);
    }
    let permit = rest.strip_prefix(b"permit.")?;
    let at = permit.iter().position(|&b| b == b'.')?;
    let (hex, slot) = (&permit[..at], &permit[at + 1..]);
    let is_hex = |b: &u8| b.is_ascii_digit() || (b'a'..=b'f').contains(b);
    (!hex.is_empty() && hex.iter().all(is_hex) && digits(slot)).then_some(NameKey::Permit)
}

/// A name as part of a key outside every lock's prefix: `%` becomes `%25` and `/` becomes `%2F`, so
/// the key has no `/` and no lock name's prefix (which ends in `/`) ever covers it.
fn escape(name: &str) -> String {
    name.replace('%', "%25").replace('/', "%2F")
}

/// Where semaphore `name`'s limit is stored: `distlock.limit.<name, escaped>`, a key with no lease
/// (kept when every permit is back) whose value is the limit in decimal. It has no `/` in it, so it is
/// under no lock's prefix: no Go `Mutex` or distlock lock waits for it. Delete it (`etcdctl del`)
/// while no permit is held to change the limit; the next permit stores its own.
///
/// ```
/// use distlock_etcd::layout;
/// assert_eq!(layout::limit_key("jobs"), "distlock.limit.jobs");
/// assert_eq!(layout::limit_key("a/b%c"), "distlock.limit.a%2Fb%25c");
/// assert_eq!(layout::write_record_key("a/b"), "distlock.write-token.a%2Fb");
/// ```
pub fn limit_key(name: &str) -> String {
    format!("distlock.limit.{}", escape(name))
}

/// Where read-write lock `name`'s last released write token is recorded (readers carry it):
/// `distlock.write-token.<name, escaped>`, no lease, the token in decimal. Written by a distlock
/// writer's release in the same txn as its key's delete ([`write_release_txn`]).
pub fn write_record_key(name: &str) -> String {
    format!("distlock.write-token.{}", escape(name))
}

/// The stored limit: first permit of a name stores `limit` at [`limit_key`] (no lease) if absent, else
/// reads what is there (responses `[put]` or `[range]`).
pub fn limit_txn(name: &str, limit: u32) -> TxnRequest {
    let key = limit_key(name);
    TxnRequest {
        compare: vec![created_at(&key, 0)],
        success: vec![put_op(&key, &limit.to_string(), 0)],
        failure: vec![range_op(RangeRequest {
            key: key.into_bytes(),
            ..RangeRequest::default()
        })],
    }
}

/// A writer's release: as [`release_txn`], and in the same txn record its token `rev` at
/// [`write_record_key`] for the readers that come after. Only a release that deletes the writer's key
/// records (a resend after a lost reply finds the key gone and records nothing), and writers hold one
/// at a time in create_revision order, so the record only grows.
pub fn write_release_txn(name: &str, key: &str, rev: i64) -> TxnRequest {
    TxnRequest {
        compare: vec![created_at(key, rev)],
        success: vec![
            delete_op(key),
            put_op(&write_record_key(name), &rev.to_string(), 0),
        ],
        failure: Vec::new(),
    }
}

/// The end of the key range of every key starting with `prefix` (etcd's `WithPrefix`): the prefix with
/// its last byte below 0xff incremented and what follows dropped; `\0` (every key) if there is none.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// A read of every key under `prefix`, sorted by create_revision.
fn prefix_range(prefix: &str, order: SortOrder) -> RangeRequest {
    RangeRequest {
        key: prefix.as_bytes().to_vec(),
        range_end: prefix_end(prefix.as_bytes()),
        sort_order: order as i32,
        sort_target: SortTarget::Create as i32,
        ..RangeRequest::default()
    }
}

fn range_op(range: RangeRequest) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestRange(range)),
    }
}

fn delete_op(key: &str) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestDeleteRange(
            DeleteRangeRequest {
                key: key.as_bytes().to_vec(),
                ..DeleteRangeRequest::default()
            },
        )),
    }
}

fn put_op(key: &str, value: &str, lease: i64) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key: key.as_bytes().to_vec(),
            value: value.as_bytes().to_vec(),
            lease,
            ..PutRequest::default()
        })),
    }
}

/// `key`'s `target` equals `value`.
fn equal(key: &str, target: CompareTarget, value: TargetUnion) -> Compare {
    Compare {
        result: CompareResult::Equal as i32,
        target: target as i32,
        key: key.as_bytes().to_vec(),
        range_end: Vec::new(),
        target_union: Some(value),
    }
}

/// `key`'s create_revision is `rev` (0: the key does not exist).
fn created_at(key: &str, rev: i64) -> Compare {
    equal(key, CompareTarget::Create, TargetUnion::CreateRevision(rev))
}

/// The oldest key under the prefix: the holder, if it is a contender ([`is_contender`]).
fn holder_get(prefix: &str) -> RequestOp {
    range_op(RangeRequest {
        limit: 1,
        ..prefix_range(prefix, SortOrder::Ascend)
    })
}

/// The newest key created before `rev` under the prefix: the predecessor to watch, if it is a
/// contender ([`is_contender`]).
fn predecessor_get(prefix: &str, rev: i64) -> RequestOp {
    range_op(predecessor(prefix, rev))
}

/// The first try, one round trip (Go's `tryAcquire` plus the predecessor read): if `key` is absent,
/// create it on `lease` with `value`; then read the holder, and the two newest keys under the prefix
/// (the own key, just created, and the one before it: the predecessor). If the key was there already (a
/// retry after a lost reply), read it instead: responses `[put | get own, get holder, get newest two]`.
/// The reads return any key under the prefix: an answer that is not a contender is read past with
/// [`keys_up_to`].
pub fn create_txn(key: &str, prefix: &str, lease: i64, value: &str) -> TxnRequest {
    let newest_two = RangeRequest {
        limit: 2,
        ..prefix_range(prefix, SortOrder::Descend)
    };
    let own = RangeRequest {
        key: key.as_bytes().to_vec(),
        ..RangeRequest::default()
    };
    TxnRequest {
        compare: vec![created_at(key, 0)],
        success: vec![
            put_op(key, value, lease),
            holder_get(prefix),
            range_op(newest_two),
        ],
        failure: vec![range_op(own), holder_get(prefix)],
    }
}

/// A later try, once queued: if the own key still has `rev` (the session lease is alive and nobody
/// deleted it — etcd issue 11456), read the holder and the predecessor.
pub fn check_txn(key: &str, prefix: &str, rev: i64) -> TxnRequest {
    TxnRequest {
        compare: vec![created_at(key, rev)],
        success: vec![holder_get(prefix), predecessor_get(prefix, rev)],
        failure: Vec::new(),
    }
}

/// A permit's try once its key exists (every try but a first one that found its own key the oldest
/// under the prefix), one round trip: if `key` still has `rev` (as [`check_txn`]) and its mod_revision
/// is still `written_at` (the last write known: its create, or the last such txn's put, so that only one
/// send of the txn writes), put it again as it is (`ignore_value`, `ignore_lease`: same value, same
/// lease, same create_revision, a new mod_revision), then read every key under the prefix created at or
/// before `rev`, oldest first, keys only (responses `[put, range]`); else read the own key (`[range]`). When the range shows the permit granted, its token is this txn's
/// revision, the put's: above every grant before it, whatever the create order of the keys (two
/// permits freed in one revision may be granted newest first). The put wakes nobody: every waiter
/// watches with etcd's `NOPUT` filter (Go's waiters skip puts too).
///
/// ```
/// use distlock_etcd::layout;
/// use distlock_etcd::rpc::pb::etcdserverpb::request_op::Request;
/// let txn = layout::permit_grant_txn("jobs/permit.1a.0", "jobs/", 7, 9);
/// assert_eq!(txn.compare.len(), 2);
/// let Some(Request::RequestPut(put)) = &txn.success[0].request else { panic!() };
/// assert!(put.ignore_value && put.ignore_lease && put.value.is_empty() && put.lease == 0);
/// let Some(Request::RequestRange(range)) = &txn.success[1].request else { panic!() };
/// assert_eq!((range.max_create_revision, range.revision, range.keys_only), (7, 0, true));
/// ```
pub fn permit_grant_txn(key: &str, prefix: &str, rev: i64, written_at: i64) -> TxnRequest {
    let same_again = RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key: key.as_bytes().to_vec(),
            ignore_value: true,
            ignore_lease: true,
            ..PutRequest::default()
        })),
    };
    TxnRequest {
        compare: vec![
            created_at(key, rev),
            equal(
                key,
                CompareTarget::Mod,
                TargetUnion::ModRevision(written_at),
            ),
        ],
        success: vec![same_again, range_op(keys_up_to(prefix, rev, 0))],
        failure: vec![range_op(RangeRequest {
            key: key.as_bytes().to_vec(),
            ..RangeRequest::default()
        })],
    }
}

/// The predecessor read alone, for the first try that found itself queued.
pub fn predecessor(prefix: &str, rev: i64) -> RangeRequest {
    RangeRequest {
        limit: 1,
        max_create_revision: rev - 1,
        ..prefix_range(prefix, SortOrder::Descend)
    }
}

/// The read further, when a `limit: 1` answer of [`create_txn`] or [`check_txn`] (or of
/// [`predecessor`]) is not a contender ([`is_contender`]): every key under the prefix created at or
/// before `rev` (the own key's), oldest first, keys only, at store revision `at` (the revision of the
/// first read, so that both are one view and the own key is known to be in it). The caller keeps the
/// contenders: the first is the holder, the last below `rev` the predecessor.
pub fn keys_up_to(prefix: &str, rev: i64, at: i64) -> RangeRequest {
    RangeRequest {
        keys_only: true,
        max_create_revision: rev,
        revision: at,
        ..prefix_range(prefix, SortOrder::Ascend)
    }
}

/// Release: delete the own key only if its create_revision is still `rev` (etcd issue 22082).
pub fn release_txn(key: &str, rev: i64) -> TxnRequest {
    TxnRequest {
        compare: vec![created_at(key, rev)],
        success: vec![delete_op(key)],
        failure: Vec::new(),
    }
}

/// An operator's break of the exclusive hold `status` showed (`distlock break`): delete `key` only
/// if its create_revision is still `rev` (the token shown) and, with an `owner`, its value is still
/// that owner id; a `writer`'s break records its token at [`write_record_key`] in the same txn, as
/// its release would ([`write_release_txn`]). Nothing else is touched: not the holder's session
/// lease, which may carry its other locks.
///
/// ```
/// use distlock_etcd::layout;
/// let txn = layout::break_txn("jobs", "jobs/1a", 42, Some("7f0c:1"), false);
/// assert_eq!((txn.compare.len(), txn.success.len()), (2, 1));
/// let txn = layout::break_txn("jobs", "jobs/write/1733540000123456789", 43, None, true);
/// assert_eq!((txn.compare.len(), txn.success.len()), (1, 2)); // the delete and the write record
/// ```
pub fn break_txn(name: &str, key: &str, rev: i64, owner: Option<&str>, writer: bool) -> TxnRequest {
    let mut txn = if writer {
        write_release_txn(name, key, rev)
    } else {
        release_txn(key, rev)
    };
    if let Some(owner) = owner {
        txn.compare.push(equal(
            key,
            CompareTarget::Value,
            TargetUnion::Value(owner.as_bytes().to_vec()),
        ));
    }
    txn
}

/// The handoff to the next local owner, one write: if `old_key` still has `old_rev` (the releaser's
/// hold) and no key under the prefix was created after it (nobody queued on the server: a Go Mutex, an
/// `etcdctl lock` or another process would be passed over), delete it and create `new_key` on `lease`
/// with `value` in the same revision, which is the new key's create_revision and so the next holder's
/// token. Otherwise release as [`release_txn`] does and read `new_key` (responses `[txn, range]`: a
/// copy of this txn that applied first made it, see `hand_off_lease`). Two keys: the
/// next owner's key is another local claim (`NAME/<lease hex>_<n>`), since etcd refuses a txn that
/// deletes and puts one key.
///
/// The "nobody after" compare covers every key under the prefix, a nested lock's too (a compare takes
/// a key range, and no key range holds exactly the contenders: [`is_contender`]). It errs on the safe
/// side: a nested lock's key created during the hold makes the handoff a plain release, and the next
/// owner acquires as usual, one round trip later, never passing anyone over and never blocked by it.
pub fn hand_off_txn(
    old_key: &str,
    old_rev: i64,
    prefix: &str,
    new_key: &str,
    lease: i64,
    value: &str,
) -> TxnRequest {
    let nobody_after = Compare {
        result: CompareResult::Less as i32,
        target: CompareTarget::Create as i32,
        key: prefix.as_bytes().to_vec(),
        range_end: prefix_end(prefix.as_bytes()),
        target_union: Some(TargetUnion::CreateRevision(old_rev.saturating_add(1))),
    };
    TxnRequest {
        compare: vec![
            created_at(old_key, old_rev),
            nobody_after,
            created_at(new_key, 0),
        ],
        success: vec![delete_op(old_key), put_op(new_key, value, lease)],
        // The release, and the new key as it is: a txn resent after its first copy applied (a lost
        // reply, a hedged copy) fails its compares, and this read shows the key that copy made.
        failure: vec![
            RequestOp {
                request: Some(request_op::Request::RequestTxn(release_txn(
                    old_key, old_rev,
                ))),
            },
            range_op(RangeRequest {
                key: new_key.as_bytes().to_vec(),
                ..RangeRequest::default()
            }),
        ],
    }
}

/// Undo of a try whose reply was lost: delete the key only if it hangs on our lease *and* holds our
/// owner id (the key name carries the lease id, but another writer given the same lease could have
/// created it: its key is left alone).
pub fn undo_txn(key: &str, lease: i64, owner: &str) -> TxnRequest {
    TxnRequest {
        compare: vec![
            equal(key, CompareTarget::Lease, TargetUnion::Lease(lease)),
            equal(
                key,
                CompareTarget::Value,
                TargetUnion::Value(owner.as_bytes().to_vec()),
            ),
        ],
        success: vec![delete_op(key)],
        failure: Vec::new(),
    }
}

/// All keys under the prefix, oldest first, for `status`, which keeps the contenders
/// ([`is_contender`]): a nested lock's keys are neither holder nor waiters.
pub fn all_keys(name: &str) -> RangeRequest {
    prefix_range(&prefix(name), SortOrder::Ascend)
}

/// A fenced write into etcd itself: put `key = value` only while `lock_key` still has the holder's
/// token as its mod_revision, so a superseded holder's write is refused by the server. The token is
/// the revision of the write that made the hold: a mutex's, a writer's and a permit granted at its
/// first try are their key's create, which nothing writes again (so mod_revision = create_revision
/// while the hold's key lives); a permit granted later carries the revision of its grant's put
/// ([`permit_grant_txn`]), the key's last write. A reader's token is not its key's (it carries the last
/// write's). Commit it with [`EtcdBackend::client`](crate::EtcdBackend::client)`().txn(...)`;
/// `succeeded` is false when the lock was no longer held.
///
/// ```
/// let txn = distlock_etcd::layout::fenced_put("orders/42/7b", 1234, "orders/42/state", "paid");
/// assert_eq!(txn.compare.len(), 1);
/// ```
pub fn fenced_put(lock_key: &str, token: u64, key: &str, value: &str) -> TxnRequest {
    let rev = i64::try_from(token).unwrap_or(i64::MAX);
    TxnRequest {
        compare: vec![equal(
            lock_key,
            CompareTarget::Mod,
            TargetUnion::ModRevision(rev),
        )],
        success: vec![put_op(key, value, 0)],
        failure: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_is_the_next_prefix() {
        assert_eq!(prefix_end(b"a/"), b"a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
    }
}
