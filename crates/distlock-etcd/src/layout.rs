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
//! * **Holder.** The key with the smallest create_revision under `NAME/`. Waiters are served in the
//!   order their keys were created (FIFO).
//! * **Token.** The holder key's create_revision: a deleted key never comes back with its old revision,
//!   and the lock always goes to the oldest live key, so it strictly increases from holder to holder.
//! * **Waiting.** A waiter watches only the key just before its own (the largest create_revision below
//!   its own), from the revision of the read that found it + 1: a watch that starts at or below the
//!   store's current revision is an "unsynced" watcher that etcd serves from a 100 ms loop, which is the
//!   handoff stall measured with etcd's server-side Lock RPC.
//! * **Release.** Delete the own key only if its create_revision is still the one acquired (Go deletes
//!   unconditionally, so a retried Unlock can delete a newer holder's key: etcd issue 22082).
//!
//! **Nesting caveat** (as in Go): the prefix of `a` is `a/`, which also covers the keys of lock `a/b`
//! (`a/b/<lease>`). So `a` and `a/b` contend with each other: whoever's key is older holds "its"
//! lock and the other waits. Avoid using both a name and a `/`-extension of it.
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

/// The oldest key under the prefix: the holder.
fn holder_get(prefix: &str) -> RequestOp {
    range_op(RangeRequest {
        limit: 1,
        ..prefix_range(prefix, SortOrder::Ascend)
    })
}

/// The newest key created before `rev` under the prefix: the predecessor to watch.
fn predecessor_get(prefix: &str, rev: i64) -> RequestOp {
    range_op(predecessor(prefix, rev))
}

/// The first try, one round trip (Go's `tryAcquire` plus the predecessor read): if `key` is absent,
/// create it on `lease` with `value`; then read the holder, and the two newest keys under the prefix
/// (the own key, just created, and the one before it: the predecessor). If the key was there already (a
/// retry after a lost reply), read it instead: responses `[put | get own, get holder, get newest two]`.
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

/// The predecessor read alone, for the first try that found itself queued.
pub fn predecessor(prefix: &str, rev: i64) -> RangeRequest {
    RangeRequest {
        limit: 1,
        max_create_revision: rev - 1,
        ..prefix_range(prefix, SortOrder::Descend)
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

/// The handoff to the next local owner, one write: if `old_key` still has `old_rev` (the releaser's
/// hold) and no key under the prefix was created after it (nobody queued on the server: a Go Mutex, an
/// `etcdctl lock` or another process would be passed over), delete it and create `new_key` on `lease`
/// with `value` in the same revision, which is the new key's create_revision and so the next holder's
/// token. Otherwise release as [`release_txn`] does and read `new_key` (responses `[txn, range]`: a
/// copy of this txn that applied first made it, see `hand_off_lease`). Two keys: the
/// next owner's key is another local claim (`NAME/<lease hex>_<n>`), since etcd refuses a txn that
/// deletes and puts one key.
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

/// All keys under the prefix, oldest first, for `status`.
pub fn all_keys(name: &str) -> RangeRequest {
    prefix_range(&prefix(name), SortOrder::Ascend)
}

/// A fenced write into etcd itself: put `key = value` only while `lock_key` still has the holder's
/// create_revision `token`, so a superseded holder's write is refused by the server. Commit it with
/// [`EtcdBackend::client`](crate::EtcdBackend::client)`().txn(...)`; `succeeded` is false when the
/// lock was no longer held.
///
/// ```
/// let txn = distlock_etcd::layout::fenced_put("orders/42/7b", 1234, "orders/42/state", "paid");
/// assert_eq!(txn.compare.len(), 1);
/// ```
pub fn fenced_put(lock_key: &str, token: u64, key: &str, value: &str) -> TxnRequest {
    let rev = i64::try_from(token).unwrap_or(i64::MAX);
    TxnRequest {
        compare: vec![created_at(lock_key, rev)],
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
