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

use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
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

/// The oldest key under the prefix: the holder.
fn holder_get(prefix: &str) -> TxnOp {
    TxnOp::get(
        prefix,
        Some(
            GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1),
        ),
    )
}

/// The newest key created before `rev` under the prefix: the predecessor to watch.
fn predecessor_get(prefix: &str, rev: i64) -> TxnOp {
    TxnOp::get(
        prefix,
        Some(
            GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_max_create_revision(rev - 1)
                .with_limit(1),
        ),
    )
}

/// The first try, one round trip (Go's `tryAcquire` plus the predecessor read): if `key` is absent,
/// create it on `lease` with `value`; then read the holder, and the two newest keys under the prefix
/// (the own key, just created, and the one before it: the predecessor). If the key was there already (a
/// retry after a lost reply), read it instead: responses `[put | get own, get holder, get newest two]`.
pub fn create_txn(key: &str, prefix: &str, lease: i64, value: &str) -> Txn {
    let newest_two = TxnOp::get(
        prefix,
        Some(
            GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_limit(2),
        ),
    );
    Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([
            TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease))),
            holder_get(prefix),
            newest_two,
        ])
        .or_else([TxnOp::get(key, None), holder_get(prefix)])
}

/// A later try, once queued: if the own key still has `rev` (the session lease is alive and nobody
/// deleted it — etcd issue 11456), read the holder and the predecessor.
pub fn check_txn(key: &str, prefix: &str, rev: i64) -> Txn {
    Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, rev)])
        .and_then([holder_get(prefix), predecessor_get(prefix, rev)])
}

/// The predecessor read alone, for the first try that found itself queued.
pub fn predecessor(prefix: &str, rev: i64) -> (String, GetOptions) {
    (
        prefix.to_string(),
        GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_max_create_revision(rev - 1)
            .with_limit(1),
    )
}

/// Release: delete the own key only if its create_revision is still `rev` (etcd issue 22082).
pub fn release_txn(key: &str, rev: i64) -> Txn {
    Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, rev)])
        .and_then([TxnOp::delete(key, None::<DeleteOptions>)])
}

/// Undo of a try whose reply was lost: delete the key only if it hangs on our lease *and* holds our
/// owner id (the key name carries the lease id, but another writer given the same lease could have
/// created it: its key is left alone).
pub fn undo_txn(key: &str, lease: i64, owner: &str) -> Txn {
    Txn::new()
        .when([
            Compare::lease(key, CompareOp::Equal, lease),
            Compare::value(key, CompareOp::Equal, owner),
        ])
        .and_then([TxnOp::delete(key, None::<DeleteOptions>)])
}

/// All keys under the prefix, oldest first, for `status`.
pub fn all_keys(name: &str) -> (String, GetOptions) {
    (
        prefix(name),
        GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend),
    )
}

/// A fenced write into etcd itself: put `key = value` only while `lock_key` still has the holder's
/// create_revision `token`, so a superseded holder's write is refused by the server. Commit it with
/// `client.txn(...)`; `succeeded()` is false when the lock was no longer held.
///
/// ```
/// let txn = distlock_etcd::layout::fenced_put("orders/42/7b", 1234, "orders/42/state", "paid");
/// # let _ = txn;
/// ```
pub fn fenced_put(lock_key: &str, token: u64, key: &str, value: &str) -> Txn {
    let rev = i64::try_from(token).unwrap_or(i64::MAX);
    Txn::new()
        .when([Compare::create_revision(lock_key, CompareOp::Equal, rev)])
        .and_then([TxnOp::put(key, value, None)])
}
