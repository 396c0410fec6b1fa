//! The on-server layout, Apache Curator's (Curator 5.x), so that distlock and Java services using
//! Curator exclude each other on the same path. Every znode name distlock writes is made here.
//!
//! **Mutex** (`InterProcessMutex`):
//!
//! * the lock name is the lock's path, `/` prefixed when it does not start with one (`orders/42` and
//!   `/orders/42` are the same lock `/orders/42`); under a chroot, relative to it;
//! * missing parents are created as **container** nodes (Curator's
//!   `creatingParentContainersIfNeeded`), which ZooKeeper reaps once empty; a parent reaped between
//!   two steps of an acquire is created again;
//! * each contender creates one **ephemeral sequential** child `_c_<uuid>-lock-<seq>`: `_c_<uuid>-`
//!   is Curator's *protected mode* prefix (a create whose reply was lost is found again by it), `lock-`
//!   is `InterProcessMutex`'s `LOCK_NAME`, `<seq>` the 10-digit sequence ZooKeeper appends;
//! * the contenders are the children named as lock nodes ([`is_lock_node`]: the mutex's and the
//!   read-write lock's), in sequence order ([`contenders`]; for mutex nodes Curator's own sort,
//!   `StandardLockInternalsDriver.fixForSorting`: the part after the **last** `lock-`, compared as
//!   strings); the holder is the first of them. Any other child is ignored: a lock nested under this
//!   one's name (`X/0`, `X/-x`, `X/ a`) makes its parent a container child of `X` (`0`, `-x`, ` a`)
//!   that Curator's sort puts ahead of every lock node, and counting it blocked `X`'s holder until the
//!   container was reaped (issue 24). Curator itself sorts **every** child
//!   (`LockInternals.getSortedChildren` does not filter): a Curator client on `X` queues behind such a
//!   container and waits, watching it, until ZooKeeper reaps it (once empty, within the server's
//!   `znode.container.checkIntervalMs`, 60 s by default). Exclusion holds all the same: a Curator
//!   client holds only when it is first among all children, so first among the lock nodes too, where
//!   distlock's holder is;
//! * a waiter watches only its predecessor among the contenders;
//! * the node's data is the owner id (Curator writes the client's IP address; `status` shows it as the
//!   holder either way);
//! * the fencing token is the lock node's `czxid` (the zxid of its create), which strictly increases
//!   across holders; the sequence suffix is not used, since it restarts when the parent is recreated.
//! * an operator's **break** (`distlock break`) deletes the holder's node (the first lock node, a
//!   mutex's or a writer's) after checking that its czxid and data are the token and owner `status`
//!   showed, at the data version read with them; the node's path is unique to its hold (the
//!   `_c_<uuid>-` prefix and the sequence), so no later holder is deleted. A broken writer's token is
//!   recorded as its release records it (below). Nothing else changes: the holder's session and its
//!   other nodes stay. The waiter watching the node and the holder's own watch see the delete.
//!   `status` shows each holder's node kind and czxid as its hold id ([`hold_id`]): a break aimed at
//!   a reader or a permit is refused, one aimed at an exclusive holder that has gone finds nothing to
//!   delete, whoever holds now.
//!
//! **Read-write lock** (`InterProcessReadWriteLock`), on the same path and the same queue:
//!
//! * readers create `_c_<uuid>-__READ__<seq>`, writers `_c_<uuid>-__WRIT__<seq>` (ephemeral
//!   sequential; the parent's one counter orders them with each other and with mutex nodes). Curator
//!   sorts them by what is left after stripping through the last `__READ__`, then through the last
//!   `__WRIT__` ([`curator_rw_sort_key`]): the sequence, as [`contenders`] does;
//! * a writer (and a mutex) holds when first among the contenders and watches its predecessor, whatever
//!   its type; a reader holds when no exclusive node (`__WRIT__` or `lock-`) is before it, and watches
//!   the **first** exclusive node otherwise ([`standing`]): Curator's `ReadLock.getsTheLock`, with the
//!   mutex's nodes counted as writers (Curator's reader does not see them: its sort puts a `lock-` node
//!   after every `__READ__`/`__WRIT__` node, see the crate docs);
//! * a downgrade creates a plain **ephemeral** `_c_<uuid>-__READ__<writer's seq>` node
//!   ([`downgrade_node_name`], Curator's CURATOR-621 fix, 5.5+), sorting in the writer's place, and
//!   deletes the writer's node in the same `multi`;
//! * a write hold's token is its node's `czxid`; each write release (and downgrade) records it, in the
//!   same `multi` as its node's delete, in the name node's data as an 8-byte big-endian long (Curator's
//!   `DistributedAtomicLong` format, [`write_record`]). A reader's token is [`reader_token`]: the newest
//!   of that record, the writer nodes it queued behind, and the name node's own `czxid`.
//!
//! **Semaphore** (`InterProcessSemaphoreV2`), under the name's node:
//!
//! * `<name>/locks` is an inner mutex (the layout above), held while a lease node is created and while
//!   its acquirer waits for a lease to free;
//! * `<name>/leases` holds one protected ephemeral sequential `_c_<uuid>-lease-<seq>` per permit
//!   ([`is_lease_node`]); a permit is held when the lease nodes, its own included, are at most the
//!   limit. Its token is the lease node's `czxid`, its permit id the lease node's name;
//! * `<name>/limit` ([`semaphore_limit_path`]), a **persistent** node, stores the limit as Curator's
//!   `SharedCount` does (a 4-byte big-endian int, [`limit_bytes`]), written by the first permit and kept
//!   (Curator stores none: `new InterProcessSemaphoreV2(client, path, new SharedCount(client,
//!   path + "/limit", n))` shares it).

use std::cmp::Ordering;

/// `InterProcessMutex`'s `LOCK_NAME`.
pub const LOCK_NAME: &str = "lock-";
/// `InterProcessReadWriteLock`'s `READ_LOCK_NAME`.
pub const READ_NAME: &str = "__READ__";
/// `InterProcessReadWriteLock`'s `WRITE_LOCK_NAME`.
pub const WRITE_NAME: &str = "__WRIT__";
/// `InterProcessSemaphoreV2`'s `LEASE_BASE_NAME`.
pub const LEASE_NAME: &str = "lease-";
/// `InterProcessSemaphoreV2`'s `LOCK_PARENT`: the inner mutex's path under the semaphore's.
pub const SEMAPHORE_LOCKS: &str = "locks";
/// `InterProcessSemaphoreV2`'s `LEASE_PARENT`: the lease nodes' parent under the semaphore's path.
pub const SEMAPHORE_LEASES: &str = "leases";
/// distlock's stored limit of a semaphore, a persistent child of its path (Curator stores none).
pub const SEMAPHORE_LIMIT: &str = "limit";
/// Curator's protected-mode prefix (`CreateBuilderImpl.PROTECTED_PREFIX`).
pub const PROTECTED_PREFIX: &str = "_c_";

/// What a lock node's name says it is: a mutex's, a reader's or a writer's.
///
/// ```
/// use distlock_zookeeper::layout::{node_type, NodeType};
/// let u = "3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f";
/// assert_eq!(node_type(&format!("_c_{u}-lock-0000000007")), Some(NodeType::Mutex));
/// assert_eq!(node_type(&format!("_c_{u}-__READ__0000000008")), Some(NodeType::Read));
/// assert_eq!(node_type(&format!("_c_{u}-__WRIT__0000000009")), Some(NodeType::Write));
/// assert_eq!(node_type(&format!("_c_{u}-lease-0000000001")), None); // a semaphore's lease node
/// assert_eq!(NodeType::Write.marker(), "__WRIT__");
/// assert!(NodeType::Mutex.is_exclusive() && NodeType::Write.is_exclusive() && !NodeType::Read.is_exclusive());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeType {
    /// `_c_<uuid>-lock-<seq>`: `InterProcessMutex`, distlock's mutex (and a semaphore's inner mutex).
    Mutex,
    /// `_c_<uuid>-__READ__<seq>`: a reader of `InterProcessReadWriteLock`.
    Read,
    /// `_c_<uuid>-__WRIT__<seq>`: a writer of `InterProcessReadWriteLock`.
    Write,
}

impl NodeType {
    /// The name part before the sequence: `lock-`, `__READ__`, `__WRIT__`.
    pub fn marker(self) -> &'static str {
        match self {
            NodeType::Mutex => LOCK_NAME,
            NodeType::Read => READ_NAME,
            NodeType::Write => WRITE_NAME,
        }
    }

    /// Whether a holder of this type excludes every other contender (mutex and writer).
    pub fn is_exclusive(self) -> bool {
        !matches!(self, NodeType::Read)
    }

    const ALL: [NodeType; 3] = [NodeType::Mutex, NodeType::Read, NodeType::Write];
}

/// What a holder `status` shows holds: a lock node of a [`NodeType`], or a semaphore's lease node.
///
/// ```
/// use distlock_zookeeper::layout::{HoldKind, NodeType};
/// // Only a mutex's or a writer's hold can be broken: readers and permits exclude no one alone.
/// assert!(HoldKind::Node(NodeType::Write).is_exclusive());
/// assert!(!HoldKind::Node(NodeType::Read).is_exclusive() && !HoldKind::Permit.is_exclusive());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HoldKind {
    /// A lock node: a mutex's, a reader's or a writer's.
    Node(NodeType),
    /// A semaphore's lease node (a permit).
    Permit,
}

impl HoldKind {
    /// Whether a holder of this kind excludes every other contender (mutex and writer).
    pub fn is_exclusive(self) -> bool {
        matches!(self, HoldKind::Node(t) if t.is_exclusive())
    }

    /// The word for the kind in a [`hold_id`].
    fn tag(self) -> &'static str {
        match self {
            HoldKind::Node(NodeType::Mutex) => "mutex",
            HoldKind::Node(NodeType::Read) => "read",
            HoldKind::Node(NodeType::Write) => "write",
            HoldKind::Permit => "permit",
        }
    }

    const ALL: [HoldKind; 4] = [
        HoldKind::Node(NodeType::Mutex),
        HoldKind::Node(NodeType::Read),
        HoldKind::Node(NodeType::Write),
        HoldKind::Permit,
    ];
}

/// The hold id `status` shows for a holder (`HolderInfo::hold_id`): its node's kind and czxid,
/// `<kind>@<czxid>`. The czxid is the node's own (a reader's token is not), so it names one hold, and
/// the kind tells a break whether it was aimed at an exclusive holder ([`parse_hold_id`]).
///
/// ```
/// use distlock_zookeeper::layout::{hold_id, parse_hold_id, HoldKind, NodeType};
/// assert_eq!(hold_id(HoldKind::Node(NodeType::Write), 42), "write@42");
/// assert_eq!(parse_hold_id("write@42"), Some((HoldKind::Node(NodeType::Write), 42)));
/// assert_eq!(parse_hold_id(&hold_id(HoldKind::Permit, 7)), Some((HoldKind::Permit, 7)));
/// for other in ["", "write", "write@", "write@x", "lock@42", "42", "write@-1"] {
///     assert_eq!(parse_hold_id(other), None, "{other:?}");
/// }
/// ```
pub fn hold_id(kind: HoldKind, czxid: i64) -> String {
    format!("{}@{czxid}", kind.tag())
}

/// A [`hold_id`]'s kind and czxid; `None` for anything else (another engine's id).
pub fn parse_hold_id(id: &str) -> Option<(HoldKind, i64)> {
    let (tag, czxid) = id.split_once('@')?;
    let kind = HoldKind::ALL.into_iter().find(|k| k.tag() == tag)?;
    let czxid: i64 = czxid.parse().ok()?;
    (czxid > 0).then_some((kind, czxid))
}

/// The lock path of a name: `/`-prefixed, checked against what ZooKeeper (and Curator's
/// `PathUtils.validatePath`) accepts. The message says what is wrong.
///
/// ```
/// use distlock_zookeeper::layout::lock_path;
/// assert_eq!(lock_path("orders/42").unwrap(), "/orders/42");
/// assert_eq!(lock_path("/orders/42").unwrap(), "/orders/42");
/// for bad in ["", "/", "a/", "a//b", "a/./b", "../a", "zookeeper/x", "/zookeeper", "a\u{1}b"] {
///     assert!(lock_path(bad).is_err(), "{bad:?}");
/// }
/// ```
pub fn lock_path(name: &str) -> Result<String, String> {
    let path = if name.starts_with('/') {
        name.to_string()
    } else {
        format!("/{name}")
    };
    check_path(&path, "lock name")?;
    if path == "/zookeeper" || path.starts_with("/zookeeper/") {
        return Err(format!(
            "the lock name {name:?} is under /zookeeper, which ZooKeeper reserves for itself"
        ));
    }
    Ok(path)
}

/// Checks a chroot (`/app/locks`) with the same rules as a lock path, and that it is absolute.
pub(crate) fn check_chroot(chroot: &str) -> Result<(), String> {
    if !chroot.starts_with('/') {
        return Err(format!("the chroot {chroot:?} must start with /"));
    }
    check_path(chroot, "chroot")?;
    if chroot == "/zookeeper" || chroot.starts_with("/zookeeper/") {
        return Err(format!(
            "the chroot {chroot:?} is under /zookeeper, which ZooKeeper reserves for itself"
        ));
    }
    Ok(())
}

/// ZooKeeper's path rules (`PathUtils.validatePath`): absolute, no empty segment, no trailing `/`,
/// no `.` or `..` segment, none of the characters it refuses.
fn check_path(path: &str, what: &str) -> Result<(), String> {
    if path == "/" {
        return Err(format!(
            "the {what} {path:?} is the root node, which cannot be locked"
        ));
    }
    if path.ends_with('/') {
        return Err(format!("the {what} {path:?} ends with /"));
    }
    for segment in path[1..].split('/') {
        match segment {
            "" => return Err(format!("the {what} {path:?} has an empty segment (//)")),
            "." | ".." => {
                return Err(format!(
                    "the {what} {path:?} has a {segment:?} segment, which ZooKeeper refuses"
                ))
            }
            _ => {}
        }
    }
    if let Some(c) = path.chars().find(|&c| forbidden(c)) {
        return Err(format!(
            "the {what} {path:?} contains the character {c:?} (U+{:04X}), which ZooKeeper refuses",
            c as u32
        ));
    }
    Ok(())
}

/// Characters `PathUtils.validatePath` refuses. It checks Java `char`s (UTF-16 code units) and refuses
/// U+D800–U+F8FF, surrogates included, so every character outside the Basic Multilingual Plane (written
/// as two surrogates) is refused too.
fn forbidden(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{10ffff}')
}

/// The path passed to the sequential create of a mutex node: `<lock path>/_c_<uuid>-lock-` (ZooKeeper
/// appends the sequence).
pub fn node_prefix(lock_path: &str, protection: &str) -> String {
    node_prefix_of(lock_path, protection, LOCK_NAME)
}

/// The path passed to the sequential create of a node named with `marker` (`lock-`, `__READ__`,
/// `__WRIT__`, `lease-`): `<parent>/_c_<uuid>-<marker>`.
///
/// ```
/// use distlock_zookeeper::layout::{node_prefix_of, READ_NAME, LEASE_NAME};
/// assert_eq!(node_prefix_of("/a", "u", READ_NAME), "/a/_c_u-__READ__");
/// assert_eq!(node_prefix_of("/s/leases", "u", LEASE_NAME), "/s/leases/_c_u-lease-");
/// ```
pub fn node_prefix_of(parent: &str, protection: &str, marker: &str) -> String {
    format!("{parent}/{}", node_name_prefix_of(protection, marker))
}

/// A mutex node's name up to the sequence: `_c_<uuid>-lock-`.
pub fn node_name_prefix(protection: &str) -> String {
    node_name_prefix_of(protection, LOCK_NAME)
}

/// A node's name up to the sequence: `_c_<uuid>-<marker>`.
pub fn node_name_prefix_of(protection: &str, marker: &str) -> String {
    format!("{PROTECTED_PREFIX}{protection}-{marker}")
}

/// The child created with `protection`, if it is among `children` (Curator's
/// `findProtectedNodeInForeground`: the first child starting with `_c_<uuid>`).
pub fn find_protected<'a>(children: &'a [String], protection: &str) -> Option<&'a str> {
    let prefix = format!("{PROTECTED_PREFIX}{protection}");
    children
        .iter()
        .find(|c| c.starts_with(&prefix))
        .map(String::as_str)
}

/// Every child created with `protection` (a create sent again after a lost reply may have left two).
pub fn protected_by<'a>(
    children: &'a [String],
    protection: &str,
) -> impl Iterator<Item = &'a str> + 'a {
    let prefix = format!("{PROTECTED_PREFIX}{protection}");
    children
        .iter()
        .filter(move |c| c.starts_with(&prefix))
        .map(String::as_str)
}

/// Curator's `StandardLockInternalsDriver.fixForSorting`: the part after the last `lock-`, or the
/// whole name if it has none.
pub fn sort_key(child: &str) -> &str {
    strip_through_last(child, LOCK_NAME)
}

/// `StandardLockInternalsDriver.standardFixForSorting(child, marker)`.
fn strip_through_last<'a>(child: &'a str, marker: &str) -> &'a str {
    match child.rfind(marker) {
        Some(i) => &child[i + marker.len()..],
        None => child,
    }
}

/// Curator's `InterProcessReadWriteLock.SortingLockInternalsDriver.fixForSorting`: strip through the
/// last `__READ__`, then through the last `__WRIT__`. For read-write lock nodes that is the sequence
/// ([`sequence`]); a mutex node keeps its whole name, so Curator's read-write clients sort it after
/// every read-write node (and its mutex clients sort read-write nodes after every mutex node: Curator's
/// two recipes do not see each other on one path).
///
/// ```
/// use distlock_zookeeper::layout::curator_rw_sort_key;
/// let u = "3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f";
/// assert_eq!(curator_rw_sort_key(&format!("_c_{u}-__READ__0000000004")), "0000000004");
/// assert_eq!(curator_rw_sort_key(&format!("_c_{u}-__WRIT__0000000003")), "0000000003");
/// let mutex = format!("_c_{u}-lock-0000000001");
/// assert_eq!(curator_rw_sort_key(&mutex), mutex);
/// ```
pub fn curator_rw_sort_key(child: &str) -> &str {
    strip_through_last(strip_through_last(child, READ_NAME), WRITE_NAME)
}

/// The sequence of a protected node named `_c_<uuid>-<marker><digits>` (Java's `UUID.toString` form),
/// `None` for any other name.
fn protected_sequence<'a>(child: &'a str, marker: &str) -> Option<&'a str> {
    let rest = child.strip_prefix(PROTECTED_PREFIX)?;
    let (uuid, sequence) = rest.split_at_checked(36)?;
    let sequence = sequence.strip_prefix('-')?.strip_prefix(marker)?;
    (is_uuid(uuid) && !sequence.is_empty() && sequence.bytes().all(|b| b.is_ascii_digit()))
        .then_some(sequence)
}

/// The type of a lock node (`_c_<uuid>-lock-<digits>`, `_c_<uuid>-__READ__<digits>`,
/// `_c_<uuid>-__WRIT__<digits>`), `None` for any other child.
pub fn node_type(child: &str) -> Option<NodeType> {
    NodeType::ALL
        .into_iter()
        .find(|t| protected_sequence(child, t.marker()).is_some())
}

/// Whether a child is a lock node: a mutex's `_c_<uuid>-lock-<digits>` (Curator's protected
/// `InterProcessMutex` node, and distlock's) or a read-write lock's `_c_<uuid>-__READ__<digits>` /
/// `_c_<uuid>-__WRIT__<digits>`: anything else under a lock path (a nested lock's container, an
/// operator's node, a semaphore's `locks`/`leases`/`limit`) is no contender.
///
/// ```
/// use distlock_zookeeper::layout::is_lock_node;
/// assert!(is_lock_node("_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-lock-0000000007"));
/// assert!(is_lock_node("_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-__READ__0000000008"));
/// assert!(is_lock_node("_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-__WRIT__0000000009"));
/// for other in ["0", "-x", " a", "lock-0000000001", "_c_x-lock-0000000001", "__READ__0000000001",
///               "locks", "leases", "limit", "_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-lease-0000000001",
///               "_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-__READ__",
///               "_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-lock-", "_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-lock-00a"] {
///     assert!(!is_lock_node(other), "{other:?}");
/// }
/// ```
pub fn is_lock_node(child: &str) -> bool {
    node_type(child).is_some()
}

/// Whether a child of a semaphore's `leases` is a lease node, `_c_<uuid>-lease-<digits>` (Curator's
/// protected `InterProcessSemaphoreV2` lease, and distlock's). Only these count against the limit: a
/// nested lock's container under `leases` holds no permit (Curator counts every child, so it sees one
/// permit fewer until the container is reaped).
///
/// ```
/// use distlock_zookeeper::layout::is_lease_node;
/// assert!(is_lease_node("_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-lease-0000000003"));
/// for other in ["lease-0000000003", "x", "_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-lock-0000000003"] {
///     assert!(!is_lease_node(other), "{other:?}");
/// }
/// ```
pub fn is_lease_node(child: &str) -> bool {
    protected_sequence(child, LEASE_NAME).is_some()
}

/// The sequence of a lock or lease node (the digits ZooKeeper appended, or for a downgrade node the
/// writer's); the whole name for any other child, as Curator's sort falls back to it.
pub fn sequence(child: &str) -> &str {
    NodeType::ALL
        .into_iter()
        .map(NodeType::marker)
        .chain([LEASE_NAME])
        .find_map(|m| protected_sequence(child, m))
        .unwrap_or(child)
}

/// `8-4-4-4-12` hex digits, as Java's `UUID.toString` and `uuid`'s `Display` write them.
fn is_uuid(text: &str) -> bool {
    text.len() == 36
        && text.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// The contenders among `children`, in queue order: the lock nodes ([`is_lock_node`]: mutex, reader
/// and writer nodes, one queue), by [`sequence`] compared as Java strings (for mutex nodes Curator's
/// `InterProcessMutex` sort, for read-write nodes its `InterProcessReadWriteLock` sort). Ties (a
/// downgrade node beside its writer's node, which a Curator downgrade leaves until the writer
/// releases) put the exclusive node first, so nothing is granted beside it. The first holds the lock.
///
/// ```
/// use distlock_zookeeper::layout::contenders;
/// let a = "_c_00000000-0000-4000-8000-000000000002-lock-0000000002";
/// let b = "_c_ffffffff-0000-4000-8000-000000000001-lock-0000000001";
/// let r = "_c_aaaaaaaa-0000-4000-8000-000000000003-__READ__0000000003";
/// let c = contenders(vec![a.to_string(), r.into(), "0".into(), " a".into(), "-x".into(), b.into()]);
/// assert_eq!(c, [b, a, r]);
/// // A Curator downgrade: the read node takes the writer's sequence; the writer's node sorts first.
/// let w = "_c_bbbbbbbb-0000-4000-8000-000000000004-__WRIT__0000000004";
/// let d = "_c_00000000-0000-4000-8000-000000000005-__READ__0000000004";
/// assert_eq!(contenders(vec![d.into(), w.into()]), [w, d]);
/// ```
pub fn contenders(children: Vec<String>) -> Vec<String> {
    let mut lock_nodes: Vec<String> = children.into_iter().filter(|c| is_lock_node(c)).collect();
    lock_nodes.sort_by(|a, b| {
        java_compare(sequence(a), sequence(b))
            .then_with(|| exclusive_first(a).cmp(&exclusive_first(b)))
            .then_with(|| a.cmp(b))
    });
    lock_nodes
}

/// 0 for an exclusive node, 1 for a reader's: the tie order of [`contenders`].
fn exclusive_first(child: &str) -> u8 {
    u8::from(node_type(child) == Some(NodeType::Read))
}

/// Sorts children as Curator's `LockInternals.getSortedChildren` does for a mutex (a stable sort by
/// [`sort_key`], compared as Java strings: by UTF-16 code units).
///
/// ```
/// use distlock_zookeeper::layout::sort_children;
/// let mut c = vec!["_c_b-lock-0000000002".to_string(), "x-lock-0000000000".into(), "_c_a-lock-0000000001".into()];
/// sort_children(&mut c);
/// assert_eq!(c, ["x-lock-0000000000", "_c_a-lock-0000000001", "_c_b-lock-0000000002"]);
/// ```
pub fn sort_children(children: &mut [String]) {
    children.sort_by(|a, b| java_compare(sort_key(a), sort_key(b)));
}

/// Java's `String.compareTo`: lexicographic by UTF-16 code unit.
fn java_compare(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// What a sorted child list says about `own`: `Ok(None)` when `own` holds the lock (first), else
/// `Ok(Some(predecessor))`; `Err(())` when `own` is not among them (its session expired or it was
/// deleted).
#[allow(clippy::result_unit_err)]
pub fn position<'a>(sorted: &'a [String], own: &str) -> Result<Option<&'a str>, ()> {
    standing(sorted, own)
}

/// Where `own` stands in the [`contenders`]: `Ok(None)` when it holds, else `Ok(Some(node to
/// watch))`; `Err(())` when it is not among them (its session expired or it was deleted). An exclusive
/// node (mutex, writer) holds when first and watches its predecessor (Curator's `maxLeases = 1`); a
/// reader holds when no exclusive node is before it and watches the first one otherwise (Curator's
/// `ReadLock.getsTheLock`: the earliest writer, not the nearest).
///
/// ```
/// use distlock_zookeeper::layout::standing;
/// let u = |n: u32| format!("_c_00000000-0000-4000-8000-{n:012}");
/// let r1 = format!("{}-__READ__0000000001", u(1));
/// let w2 = format!("{}-__WRIT__0000000002", u(2));
/// let r3 = format!("{}-__READ__0000000003", u(3));
/// let m4 = format!("{}-lock-0000000004", u(4));
/// let r5 = format!("{}-__READ__0000000005", u(5));
/// let q = vec![r1.clone(), w2.clone(), r3.clone(), m4.clone(), r5.clone()];
/// assert_eq!(standing(&q, &r1), Ok(None));              // a reader before every writer holds
/// assert_eq!(standing(&q, &w2), Ok(Some(r1.as_str())));  // a writer watches its predecessor
/// assert_eq!(standing(&q, &r3), Ok(Some(w2.as_str())));  // a reader watches the first writer
/// assert_eq!(standing(&q, &r5), Ok(Some(w2.as_str())));  // ... a mutex node counts as a writer
/// assert_eq!(standing(&q, &m4), Ok(Some(r3.as_str())));
/// assert_eq!(standing(&q, "gone"), Err(()));
/// ```
#[allow(clippy::result_unit_err)]
pub fn standing<'a>(sorted: &'a [String], own: &str) -> Result<Option<&'a str>, ()> {
    let Some(at) = sorted.iter().position(|c| c == own) else {
        return Err(());
    };
    if node_type(own) == Some(NodeType::Read) {
        let first_exclusive = sorted[..at]
            .iter()
            .find(|c| node_type(c).is_some_and(NodeType::is_exclusive));
        return Ok(first_exclusive.map(String::as_str));
    }
    Ok(at.checked_sub(1).map(|i| sorted[i].as_str()))
}

/// The name of the plain ephemeral read node a downgrade creates in place of the writer's node
/// `write_node`: `_c_<uuid>-__READ__<the writer's sequence>` (Curator 5.5's
/// `ReadLock.getSortingSequence`, CURATOR-621), so it sorts where the writer was and no writer queued
/// behind it gets in. `None` when `write_node` is no writer's node.
///
/// ```
/// use distlock_zookeeper::layout::downgrade_node_name;
/// let w = "_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-__WRIT__0000000042";
/// assert_eq!(downgrade_node_name("p", w).as_deref(), Some("_c_p-__READ__0000000042"));
/// assert_eq!(downgrade_node_name("p", "_c_3f2b8c1e-7d4a-4b5e-9c6f-0a1b2c3d4e5f-lock-0000000042"), None);
/// ```
pub fn downgrade_node_name(protection: &str, write_node: &str) -> Option<String> {
    let sequence = protected_sequence(write_node, WRITE_NAME)?;
    Some(format!(
        "{}{sequence}",
        node_name_prefix_of(protection, READ_NAME)
    ))
}

/// The name node's data after a write release: the writer's token (`czxid`) as an 8-byte big-endian
/// long, the format of Curator's `DistributedAtomicLong`.
///
/// ```
/// use distlock_zookeeper::layout::{parse_write_record, write_record};
/// assert_eq!(write_record(0x0102), [0, 0, 0, 0, 0, 0, 1, 2]);
/// assert_eq!(parse_write_record(&write_record(77)), Some(77));
/// assert_eq!(parse_write_record(b""), None); // Curator's (and distlock's) containers hold nothing
/// assert_eq!(parse_write_record(b"10.0.0.12"), None);
/// // Any 8 bytes parse (`10.0.0.1` too): `reader_token` keeps only a record between the name node's
/// // czxid and the reader's own.
/// ```
pub fn write_record(token: i64) -> [u8; 8] {
    token.to_be_bytes()
}

/// The write token recorded in the name node's data ([`write_record`]), if the data is one.
pub fn parse_write_record(data: &[u8]) -> Option<i64> {
    <[u8; 8]>::try_from(data).ok().map(i64::from_be_bytes)
}

/// A reader's token: the newest of the name node's `czxid` (below every write under this name node,
/// above every write of an earlier name node, reaped since), the recorded write token (only if it lies
/// between that and the reader's own node's `czxid`: a record above it would not be a write granted
/// before this reader), and `seen`, the newest writer node the reader queued behind. So it is never
/// above a write granted after the reader (those nodes come after the reader's).
///
/// ```
/// use distlock_zookeeper::layout::reader_token;
/// assert_eq!(reader_token(100, Some(150), 200, 0), 150);  // the last write's token
/// assert_eq!(reader_token(100, None, 200, 0), 100);       // no write recorded: the name node's czxid
/// assert_eq!(reader_token(100, Some(250), 200, 0), 100);  // not a write before this reader: ignored
/// assert_eq!(reader_token(100, Some(150), 200, 170), 170); // a Curator writer it queued behind
/// ```
pub fn reader_token(name_czxid: i64, record: Option<i64>, own_czxid: i64, seen: i64) -> i64 {
    let recorded = record
        .filter(|r| *r > name_czxid && *r < own_czxid)
        .unwrap_or(name_czxid);
    recorded.max(name_czxid).max(seen)
}

/// A semaphore's inner mutex path, `<path>/locks`.
///
/// ```
/// use distlock_zookeeper::layout::{semaphore_leases_path, semaphore_limit_path, semaphore_locks_path};
/// assert_eq!(semaphore_locks_path("/jobs"), "/jobs/locks");
/// assert_eq!(semaphore_leases_path("/jobs"), "/jobs/leases");
/// assert_eq!(semaphore_limit_path("/jobs"), "/jobs/limit");
/// ```
pub fn semaphore_locks_path(path: &str) -> String {
    join(path, SEMAPHORE_LOCKS)
}

/// A semaphore's lease nodes' parent, `<path>/leases`.
pub fn semaphore_leases_path(path: &str) -> String {
    join(path, SEMAPHORE_LEASES)
}

/// A semaphore's stored limit, `<path>/limit`.
pub fn semaphore_limit_path(path: &str) -> String {
    join(path, SEMAPHORE_LIMIT)
}

/// The stored limit's data: a 4-byte big-endian int, as Curator's `SharedCount.toBytes` writes it.
///
/// ```
/// use distlock_zookeeper::layout::{limit_bytes, parse_limit};
/// assert_eq!(limit_bytes(3), [0, 0, 0, 3]);
/// assert_eq!(parse_limit(&limit_bytes(65_536)), Ok(65_536));
/// assert!(parse_limit(b"3").is_err());
/// assert!(parse_limit(&(-1i32).to_be_bytes()).is_err());
/// assert!(parse_limit(&0i32.to_be_bytes()).is_err());
/// ```
pub fn limit_bytes(limit: u32) -> [u8; 4] {
    limit.to_be_bytes()
}

/// The limit stored in `data` ([`limit_bytes`]); a message saying what is there instead.
pub fn parse_limit(data: &[u8]) -> Result<u32, String> {
    let Ok(bytes) = <[u8; 4]>::try_from(data) else {
        return Err(format!(
            "holds {} bytes, not a limit (a 4-byte big-endian int, as Curator's SharedCount writes)",
            data.len()
        ));
    };
    let value = i32::from_be_bytes(bytes);
    match u32::try_from(value) {
        Ok(limit) if (1..=distlock_core::MAX_PERMITS).contains(&limit) => Ok(limit),
        _ => Err(format!(
            "holds the limit {value}, outside 1..={}",
            distlock_core::MAX_PERMITS
        )),
    }
}

/// `parent/child`.
pub(crate) fn join(parent: &str, child: &str) -> String {
    format!("{parent}/{child}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(children: &[&str]) -> Vec<String> {
        let mut c: Vec<String> = children.iter().map(|s| s.to_string()).collect();
        sort_children(&mut c);
        c
    }

    #[test]
    fn curator_sorts_by_the_suffix_after_the_last_lock_dash() {
        // Protection prefixes (random uuids) must not decide the order: the sequence does.
        let c = sorted(&[
            "_c_ffff0000-0000-0000-0000-000000000000-lock-0000000003",
            "_c_00000000-0000-0000-0000-000000000000-lock-0000000007",
            "_c_88880000-0000-0000-0000-000000000000-lock-0000000001",
        ]);
        assert_eq!(sort_key(&c[0]), "0000000001");
        assert_eq!(sort_key(&c[1]), "0000000003");
        assert_eq!(sort_key(&c[2]), "0000000007");
    }

    #[test]
    fn curator_includes_children_without_the_pattern_sorted_by_their_whole_name() {
        // "foo" has no `lock-`: its key is "foo", which sorts after the digits.
        let c = sorted(&["foo", "_c_a-lock-0000000002", "0", "x-lock-0000000001"]);
        assert_eq!(c, ["0", "x-lock-0000000001", "_c_a-lock-0000000002", "foo"]);
    }

    #[test]
    fn curator_uses_the_last_lock_dash() {
        assert_eq!(sort_key("_c_u-lock-lock-0000000005"), "0000000005");
        assert_eq!(sort_key("lock-"), "");
    }

    #[test]
    fn position_names_the_predecessor() {
        let c = sorted(&["_c_a-lock-0000000001", "_c_b-lock-0000000002"]);
        assert_eq!(position(&c, "_c_a-lock-0000000001"), Ok(None));
        assert_eq!(
            position(&c, "_c_b-lock-0000000002"),
            Ok(Some("_c_a-lock-0000000001"))
        );
        assert_eq!(position(&c, "_c_z-lock-0000000009"), Err(()));
    }

    #[test]
    fn protected_nodes_are_found_by_their_uuid() {
        let c = vec![
            "_c_aaaa-lock-0000000001".to_string(),
            "_c_bbbb-lock-0000000002".to_string(),
        ];
        assert_eq!(find_protected(&c, "bbbb"), Some("_c_bbbb-lock-0000000002"));
        assert_eq!(find_protected(&c, "cccc"), None);
        assert_eq!(node_prefix("/a/b", "bbbb"), "/a/b/_c_bbbb-lock-");
    }

    #[test]
    fn names_map_to_paths() {
        assert_eq!(lock_path("a").as_deref(), Ok("/a"));
        assert_eq!(lock_path("a/b c").as_deref(), Ok("/a/b c"));
        assert!(lock_path("zookeeperx").is_ok());
        for bad in [
            "",
            "a/",
            "a//b",
            "a/..",
            ".",
            "zookeeper",
            "a\u{7f}",
            "a\u{e000}",
            "emoji-\u{1F600}",
        ] {
            assert!(lock_path(bad).is_err(), "{bad:?}");
        }
    }
}
