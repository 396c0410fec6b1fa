//! A lock and a lock nested under its name (issue 24): `X/0`, `X/-x` and `X/ a` make a container child
//! of `X`'s znode (`0`, `-x`, ` a`) that Curator's sort puts ahead of every lock node. Only lock nodes
//! (`_c_<uuid>-lock-<seq>`) contend, so neither blocks the other and `status X` never names the
//! container as holder.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{locks_at, name, raw_client, wait_children};
use distlock_testkit::zookeeper::ZkServer;

/// Nested first, then the outer name: before issue 24 the outer acquire queued behind the container
/// (`try_acquire` said busy, `status X` named the container as holder), and an outer waiter stayed
/// blocked behind it after the outer holder released, until the container was reaped (up to a minute
/// after the nested lock was released).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_nested_under_a_name_never_blocks_it_and_status_shows_no_container() {
    let server = ZkServer::start_or_panic();
    let locks = locks_at(&server.url()).await;
    let others = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    for nested in ["0", "-x", " a"] {
        let outer = name("nested");
        let inner = format!("{outer}/{nested}");

        // Nothing holds the outer name while only the nested one is held.
        let inner_guard = locks.lock(&inner).unwrap().acquire().await.unwrap();
        let status = locks.inspect(&outer).await.unwrap();
        assert!(
            status.holder.is_none(),
            "{nested:?}: status names a holder of a free lock: {:?}",
            status.holder
        );
        assert_eq!(status.waiters.unwrap_or(0), 0, "{nested:?}");
        let outer_guard = locks
            .lock(&outer)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{nested:?}: the outer lock is free but busy"));
        let status = locks.inspect(&outer).await.unwrap();
        let holder = status.holder.expect("the outer lock is held");
        assert_eq!(holder.token, outer_guard.token(), "{nested:?}");

        // A waiter on the outer name is granted when its holder releases, the container still there.
        let waiter_lock = others.lock(&outer).unwrap();
        let waiter = tokio::spawn(async move {
            waiter_lock
                .options()
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        });
        // The container and two lock nodes.
        wait_children(&raw, &outer, 3).await;
        outer_guard.release().await.unwrap();
        let granted = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .unwrap_or_else(|_| panic!("{nested:?}: the waiter is blocked behind the container"))
            .unwrap()
            .unwrap();
        // And the nested lock is untouched by the outer one's holders.
        assert!(others
            .lock(&inner)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none());
        granted.release().await.unwrap();
        inner_guard.release().await.unwrap();
    }
}
