//! The on-server layout, Apache Curator's `InterProcessMutex` (Curator 5.x), so that distlock and
//! Java services using Curator exclude each other on the same path:
//!
//! * the lock name is the lock's path, `/` prefixed when it does not start with one (`orders/42` and
//!   `/orders/42` are the same lock `/orders/42`); under a chroot, relative to it;
//! * missing parents are created as **container** nodes (Curator's
//!   `creatingParentContainersIfNeeded`), which ZooKeeper reaps once empty; a parent reaped between
//!   two steps of an acquire is created again;
//! * each contender creates one **ephemeral sequential** child `_c_<uuid>-lock-<seq>`: `_c_<uuid>-`
//!   is Curator's *protected mode* prefix (a create whose reply was lost is found again by it), `lock-`
//!   is `InterProcessMutex`'s `LOCK_NAME`, `<seq>` the 10-digit sequence ZooKeeper appends;
//! * the holder is the first child in Curator's own sort (`StandardLockInternalsDriver.fixForSorting`):
//!   children ordered by the part after the **last** `lock-` in their name (the whole name if none),
//!   compared as strings, **every** child included, also ones not matching the pattern;
//! * a waiter watches only its predecessor in that order;
//! * the node's data is the owner id (Curator writes the client's IP address; `status` shows it as the
//!   holder either way);
//! * the fencing token is the lock node's `czxid` (the zxid of its create), which strictly increases
//!   across holders; the sequence suffix is not used, since it restarts when the parent is recreated.

use std::cmp::Ordering;

/// `InterProcessMutex`'s `LOCK_NAME`.
pub const LOCK_NAME: &str = "lock-";
/// Curator's protected-mode prefix (`CreateBuilderImpl.PROTECTED_PREFIX`).
pub const PROTECTED_PREFIX: &str = "_c_";

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

/// The path passed to the sequential create: `<lock path>/_c_<uuid>-lock-` (ZooKeeper appends the
/// sequence).
pub fn node_prefix(lock_path: &str, protection: &str) -> String {
    format!("{lock_path}/{}", node_name_prefix(protection))
}

/// A child's name up to the sequence: `_c_<uuid>-lock-`.
pub fn node_name_prefix(protection: &str) -> String {
    format!("{PROTECTED_PREFIX}{protection}-{LOCK_NAME}")
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
    match child.rfind(LOCK_NAME) {
        Some(i) => &child[i + LOCK_NAME.len()..],
        None => child,
    }
}

/// Sorts children as Curator's `LockInternals.getSortedChildren` does (a stable sort by
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
    match sorted.iter().position(|c| c == own) {
        None => Err(()),
        Some(0) => Ok(None),
        Some(i) => Ok(Some(sorted[i - 1].as_str())),
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
