//! `distlock break` on etcd (`Locks::break_holder`) at the backend's default settings (60 s session
//! TTL, keep-alives every 20 s): the broken holder's key is deleted by its create_revision, the
//! broken guard goes `Lost` from its held-key watch within a round trip (not at a keep-alive, which
//! would still succeed: the session lease is not revoked), a waiter gets the lock at once, the
//! holder's other locks on the same session stay held, and readers or permits are not broken (a
//! break aimed at one is `Unsupported`; one aimed at a writer that has gone while readers hold now
//! is `Ok(false)`).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use distlock_core::raw::HolderInfo;
use distlock_core::{ErrorKind, LockState, Locks};
use distlock_etcd::layout;
use distlock_testkit::etcd::EtcdServer;

/// Far below the default session TTL (60 s) and its keep-alive period (20 s), by which a loss could
/// also come from the session; slack for a loaded 2-core machine.
const PROMPT: Duration = Duration::from_secs(5);

/// The exclusive holder `status` shows for `name`.
async fn shown(locks: &Locks, name: &str) -> HolderInfo {
    locks
        .inspect(name)
        .await
        .expect("inspect")
        .holder
        .expect("inspect shows the holder")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_holder_is_lost_and_its_waiter_granted_promptly_at_the_default_ttl() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let name = common::name("break_default");
    let holder_backend = common::backend(&url).await;
    assert_eq!(holder_backend.default_lease(), Duration::from_secs(60));
    let holder = common::locks_on(&holder_backend);
    let waiter = common::locks(&url).await;
    let operator = common::locks(&url).await;
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let leases = holder_backend.session_leases().await;
    let waiting = {
        let lock = waiter.lock(&name).unwrap();
        tokio::spawn(async move {
            let guard = lock.acquire().await;
            (lock, guard)
        })
    };
    common::wait_keys(
        &server.endpoints(),
        &layout::prefix(&name),
        PROMPT,
        "the waiter queued",
        |keys| keys.len() == 2,
    );

    let info = shown(&operator, &name).await;
    assert_eq!(info.token, held.token());
    assert_eq!(info.owner.as_deref(), Some(held.owner()));
    let started = Instant::now();
    assert!(operator.break_holder(&name, &info).await.expect("break"));

    tokio::time::timeout(PROMPT, held.lost())
        .await
        .expect("the broken holder's guard goes Lost from its watch, not at its session's TTL");
    assert_eq!(held.state(), LockState::Lost);
    let (_lock, next) = tokio::time::timeout(PROMPT, waiting)
        .await
        .expect("the waiter gets the broken lock promptly")
        .unwrap();
    let next = next.expect("acquire");
    assert!(started.elapsed() < PROMPT, "took {:?}", started.elapsed());
    assert!(next.token().unwrap() > info.token.unwrap());
    // Only the key went: the holder's session lease is the same, alive.
    assert_eq!(holder_backend.session_leases().await, leases);
    // The same holder again: it no longer holds, nothing is touched.
    assert!(!operator.break_holder(&name, &info).await.expect("break"));
    assert_eq!(next.state(), LockState::Held);
    assert!(holder
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    next.release().await.unwrap();
    drop(held);
}

/// The break deletes one key, never the session lease: the holder's other lock on the same `Locks`
/// (the same session lease) stays `Held` and cannot be taken by anyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_leaves_the_holders_other_locks_on_its_session_alone() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let base = common::name("break_session");
    let (broken_name, kept_name) = (format!("{base}/broken"), format!("{base}/kept"));
    let holder_backend = common::backend(&url).await;
    let holder = common::locks_on(&holder_backend);
    let other = common::locks(&url).await;
    let broken = holder.lock(&broken_name).unwrap().acquire().await.unwrap();
    let kept = holder.lock(&kept_name).unwrap().acquire().await.unwrap();
    let leases = holder_backend.session_leases().await;
    assert_eq!(leases.len(), 1, "both locks on one session: {leases:?}");
    let kept_key = common::keys(&server.endpoints(), &layout::prefix(&kept_name));

    let info = shown(&other, &broken_name).await;
    assert!(other
        .break_holder(&broken_name, &info)
        .await
        .expect("break"));
    tokio::time::timeout(PROMPT, broken.lost())
        .await
        .expect("the broken guard goes Lost");
    // Past the loss's handling, and a renewal's round trip later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(kept.state(), LockState::Held);
    assert_eq!(holder_backend.session_leases().await, leases);
    assert_eq!(
        common::keys(&server.endpoints(), &layout::prefix(&kept_name)),
        kept_key,
        "the other lock's key is untouched"
    );
    assert!(
        other
            .lock(&kept_name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "the other lock of the broken holder's session was taken"
    );
    let taken = other
        .lock(&broken_name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(taken.is_some(), "the broken lock is free");
    kept.release().await.unwrap();
}

/// Readers and permits are not exclusive holders: a break aimed at one (as `status` shows it, or
/// built by hand with its owner and token alone) is `Unsupported` and they keep holding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaking_readers_or_permits_is_unsupported_and_leaves_them_holding() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let holder = common::locks(&url).await;
    let operator = common::locks(&url).await;

    let name = common::name("break_readers");
    // Two owners (one owner's second read is reentrant: the same key).
    let r1 = holder.read_write(&name).unwrap().read().await.unwrap();
    let r2 = operator.read_write(&name).unwrap().read().await.unwrap();
    let info = operator.inspect(&name).await.unwrap();
    assert_eq!(info.holders.len(), 2, "{info:?}");
    for reader in &info.holders {
        assert!(
            reader
                .hold_id
                .as_deref()
                .is_some_and(|id| id.starts_with("read@")),
            "{reader:?}"
        );
        let mut by_hand = reader.clone();
        by_hand.hold_id = None;
        for aimed in [reader, &by_hand] {
            let refused = operator
                .break_holder(&name, aimed)
                .await
                .expect_err("a reader is not broken");
            assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
            assert!(refused.to_string().contains("exclusive"), "{refused}");
            assert!(refused.to_string().contains("a reader"), "{refused}");
        }
    }
    let keys = common::keys(&server.endpoints(), &layout::prefix(&name));
    assert_eq!(keys.len(), 2, "both readers' keys are there: {keys:?}");
    assert_eq!((r1.state(), r2.state()), (LockState::Held, LockState::Held));
    let writer = operator.read_write(&name).unwrap();
    assert!(writer.writer().try_acquire().await.unwrap().is_none());

    let sem = common::name("break_permits");
    let permits = holder.semaphore(&sem, 2).unwrap();
    let p1 = permits.acquire().await.unwrap();
    let info = operator.inspect(&sem).await.unwrap();
    let permit = &info.holders[0];
    let mut by_hand = permit.clone();
    (by_hand.hold_id, by_hand.permit) = (None, None);
    for aimed in [permit, &by_hand] {
        let refused = operator
            .break_holder(&sem, aimed)
            .await
            .expect_err("a permit is not broken");
        assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
        assert!(refused.to_string().contains("permit"), "{refused}");
    }
    assert_eq!(p1.state(), LockState::Held);
    assert_eq!(
        common::keys(&server.endpoints(), &layout::prefix(&sem)).len(),
        1
    );
    p1.release().await.unwrap();
    r1.release().await.unwrap();
    r2.release().await.unwrap();
}

/// A break aimed at a writer that has gone while readers hold the name now ends nothing and is no
/// error: `Ok(false)`, the readers keep holding. So also when one reader is the writer's own
/// `RwLock` (the same owner id, and the token its write recorded): the hold id `status` showed tells
/// the writer's key from the reader's. Without the hold id (a holder built by hand) that reader
/// cannot be told from the writer, and the break is refused as aimed at a reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_writer_break_while_readers_hold_breaks_nothing() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let name = common::name("break_stale_writer");
    let holder = common::locks(&url).await;
    let other = common::locks(&url).await;
    let operator = common::locks(&url).await;
    let rw = holder.read_write(&name).unwrap();
    let written = rw.write().await.unwrap();
    let writer_shown = shown(&operator, &name).await;
    assert!(
        writer_shown
            .hold_id
            .as_deref()
            .is_some_and(|id| id.starts_with("write@")),
        "{writer_shown:?}"
    );
    written.release().await.unwrap();
    let mut writer_by_hand = writer_shown.clone();
    writer_by_hand.hold_id = None;

    // Another owner reads now.
    let other_read = other.read_write(&name).unwrap().read().await.unwrap();
    for aimed in [&writer_shown, &writer_by_hand] {
        assert!(
            !operator
                .break_holder(&name, aimed)
                .await
                .expect("a stale break of a writer while readers hold is no error"),
            "a reader was broken by a break aimed at a writer"
        );
    }
    assert_eq!(
        common::keys(&server.endpoints(), &layout::prefix(&name)).len(),
        1
    );

    // The writer's own `RwLock` reads too: its reader shows the writer's owner and token.
    let own_read = rw.read().await.unwrap();
    let info = operator.inspect(&name).await.unwrap();
    assert!(
        info.holders
            .iter()
            .any(|h| h.owner == writer_shown.owner && h.token == writer_shown.token),
        "the own reader shows the writer's owner and token: {info:?}"
    );
    assert!(!operator
        .break_holder(&name, &writer_shown)
        .await
        .expect("a stale break of a writer while its own reader holds is no error"));
    let refused = operator
        .break_holder(&name, &writer_by_hand)
        .await
        .expect_err("without a hold id the writer shown is its own reader");
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    assert_eq!(
        common::keys(&server.endpoints(), &layout::prefix(&name)).len(),
        2
    );
    assert_eq!(
        (own_read.state(), other_read.state()),
        (LockState::Held, LockState::Held)
    );
    assert!(operator
        .read_write(&name)
        .unwrap()
        .writer()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    own_read.release().await.unwrap();
    other_read.release().await.unwrap();
}

/// A writer is an exclusive holder: broken as a mutex holder is, its token recorded as its release
/// would, so the reader waiting behind it carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_writer_records_its_token_for_the_readers_after_it() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let name = common::name("break_writer");
    let holder = common::locks(&url).await;
    let reader = common::locks(&url).await;
    let operator = common::locks(&url).await;
    let writing = holder.read_write(&name).unwrap().write().await.unwrap();
    let waiting = {
        let rw = reader.read_write(&name).unwrap();
        tokio::spawn(async move { rw.read().await })
    };
    common::wait_keys(
        &server.endpoints(),
        &layout::prefix(&name),
        PROMPT,
        "the reader queued",
        |keys| keys.len() == 2,
    );
    let info = shown(&operator, &name).await;
    assert_eq!(info.token, writing.token());
    assert!(operator.break_holder(&name, &info).await.expect("break"));
    tokio::time::timeout(PROMPT, writing.lost())
        .await
        .expect("the broken writer goes Lost");
    let read = tokio::time::timeout(PROMPT, waiting)
        .await
        .expect("the reader gets the lock")
        .unwrap()
        .expect("read");
    assert_eq!(
        read.token(),
        info.token,
        "the reader carries the broken write's token"
    );
    read.release().await.unwrap();
}

/// A Go client's hold (`etcdctl lock`, no owner id in its key) is broken by its token alone, and an
/// aim with neither token nor owner is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_without_owner_id_is_broken_by_its_token() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let name = common::name("break_go");
    let operator = common::locks(&url).await;
    let raw =
        distlock_etcd::rpc::Client::connect(&distlock_etcd::EtcdConfig::new([server.endpoints()]))
            .await
            .unwrap();
    // A Go `concurrency.Mutex` key: NAME/<lease hex> on its lease, empty value.
    let lease = raw
        .lease_grant(distlock_etcd::rpc::pb::etcdserverpb::LeaseGrantRequest {
            ttl: 60,
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    let key = layout::key(&name, lease);
    raw.put(distlock_etcd::rpc::pb::etcdserverpb::PutRequest {
        key: key.clone().into_bytes(),
        lease,
        ..Default::default()
    })
    .await
    .unwrap();
    let info = shown(&operator, &name).await;
    assert_eq!(info.owner, None);
    let refused = operator
        .break_holder(&name, &HolderInfo::default())
        .await
        .expect_err("an aim at nobody");
    assert_eq!(refused.kind(), ErrorKind::InvalidConfig, "{refused}");
    assert!(operator.break_holder(&name, &info).await.expect("break"));
    assert!(common::keys(&server.endpoints(), &layout::prefix(&name)).is_empty());
    let ttl = raw.lease_time_to_live(lease).await.unwrap().ttl;
    assert!(ttl > 0, "the Go client's lease lives on");
}
