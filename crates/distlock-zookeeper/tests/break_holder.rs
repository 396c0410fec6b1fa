//! `distlock break` on ZooKeeper (`Locks::break_holder`) at the backend's default settings (60 s
//! session asked, renewals every few seconds at most a third of the TTL): the broken holder's node is
//! deleted at the version read with its czxid, the broken guard goes `Lost` from its session's watch
//! on the node within a round trip (its session lives on, with its other locks), the waiter watching
//! the node gets the lock at once, a broken writer's token is recorded as its release would, and
//! readers or permits are not broken (a break aimed at one is `Unsupported`; one aimed at a writer
//! that has gone while readers hold now is `Ok(false)`).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{children, name, raw_client, wait_children, Curator};
use distlock_core::raw::HolderInfo;
use distlock_core::{ErrorKind, LockState, Locks};
use distlock_testkit::zookeeper::ZkServer;
use distlock_zookeeper::{layout, ZkBackend};

/// Far below the default session timeout (60 s asked), by which a loss could also come from the
/// session or the core's deadline; slack for a loaded 2-core machine.
const PROMPT: Duration = Duration::from_secs(5);

async fn backend_at(url: &str) -> ZkBackend {
    let url = distlock_core::url::LockUrl::parse(url).unwrap();
    ZkBackend::connect(&url).await.expect("connect")
}

fn locks_on(backend: &ZkBackend) -> Locks {
    Locks::with_defaults(backend.clone(), backend.default_options())
}

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
async fn a_broken_holder_is_lost_and_its_waiter_granted_promptly_at_the_default_lease() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let holder_backend = backend_at(&server.url()).await;
    assert!(
        holder_backend.default_lease() >= PROMPT * 4,
        "{:?}",
        holder_backend.default_lease()
    );
    let holder = locks_on(&holder_backend);
    let waiter = locks_on(&backend_at(&server.url()).await);
    let operator = locks_on(&backend_at(&server.url()).await);
    let base = name("break_default");
    let (broken_name, kept_name) = (format!("{base}/broken"), format!("{base}/kept"));
    let held = holder.lock(&broken_name).unwrap().acquire().await.unwrap();
    // Another lock of the same session: a break ends one hold, not the session.
    let kept = holder.lock(&kept_name).unwrap().acquire().await.unwrap();
    let session = holder_backend
        .session_info(holder_backend.default_lease())
        .expect("the default session");
    let waiting = {
        let lock = waiter.lock(&broken_name).unwrap();
        tokio::spawn(async move {
            let guard = lock.acquire().await;
            (lock, guard)
        })
    };
    let queued = wait_children(&raw, &broken_name, 2).await;

    let info = shown(&operator, &broken_name).await;
    assert_eq!(info.token, held.token());
    assert_eq!(info.owner.as_deref(), Some(held.owner()));
    let started = Instant::now();
    assert!(operator
        .break_holder(&broken_name, &info)
        .await
        .expect("break"));
    tokio::time::timeout(PROMPT, held.lost()).await.expect(
        "the broken holder's guard goes Lost from its node watch, not at its session's end",
    );
    let reason = held.loss_reason().unwrap();
    assert!(reason.contains(&queued[0]), "{reason}");
    let (_lock, next) = tokio::time::timeout(PROMPT, waiting)
        .await
        .expect("the waiter gets the broken lock promptly")
        .unwrap();
    let next = next.expect("acquire");
    assert!(started.elapsed() < PROMPT, "took {:?}", started.elapsed());
    assert!(next.token().unwrap() > info.token.unwrap());
    assert_eq!(children(&raw, &broken_name).await, queued[1..].to_vec());

    // The holder's session and its other lock live on.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(kept.state(), LockState::Held);
    assert_eq!(
        holder_backend
            .session_info(holder_backend.default_lease())
            .map(|s| s.id()),
        Some(session.id())
    );
    assert!(operator
        .lock(&kept_name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    // The same holder again: it no longer holds, nothing is touched.
    assert!(!operator
        .break_holder(&broken_name, &info)
        .await
        .expect("break"));
    assert_eq!(next.state(), LockState::Held);
    next.release().await.unwrap();
    kept.release().await.unwrap();
    drop(held);
}

/// Readers and permits are not exclusive holders: a break aimed at one (as `status` shows it, or
/// built by hand with its owner and token alone) is `Unsupported` and they keep holding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaking_readers_or_permits_is_unsupported_and_leaves_them_holding() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let holder = locks_on(&backend_at(&server.url()).await);
    let operator = locks_on(&backend_at(&server.url()).await);

    let name_rw = name("break_readers");
    let r1 = holder.read_write(&name_rw).unwrap().read().await.unwrap();
    let r2 = operator.read_write(&name_rw).unwrap().read().await.unwrap();
    let info = operator.inspect(&name_rw).await.unwrap();
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
                .break_holder(&name_rw, aimed)
                .await
                .expect_err("a reader is not broken");
            assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
            assert!(refused.to_string().contains("exclusive"), "{refused}");
            assert!(refused.to_string().contains("a reader"), "{refused}");
        }
    }
    assert_eq!(children(&raw, &name_rw).await.len(), 2);
    assert_eq!((r1.state(), r2.state()), (LockState::Held, LockState::Held));
    let writer = operator.read_write(&name_rw).unwrap();
    assert!(writer.writer().try_acquire().await.unwrap().is_none());

    let name_sem = name("break_permits");
    let p1 = holder
        .semaphore(&name_sem, 2)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let info = operator.inspect(&name_sem).await.unwrap();
    assert_eq!(info.holders.len(), 1, "{info:?}");
    let permit = &info.holders[0];
    let mut by_hand = permit.clone();
    (by_hand.hold_id, by_hand.permit) = (None, None);
    for aimed in [permit, &by_hand] {
        let refused = operator
            .break_holder(&name_sem, aimed)
            .await
            .expect_err("a permit is not broken");
        assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
        assert!(refused.to_string().contains("permit"), "{refused}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(p1.state(), LockState::Held);
    let leases = children(&raw, &format!("{name_sem}/leases")).await;
    assert_eq!(leases.len(), 1, "{leases:?}");
    p1.release().await.unwrap();
    r1.release().await.unwrap();
    r2.release().await.unwrap();
}

/// A break aimed at a writer that has gone while readers hold the name now ends nothing and is no
/// error: `Ok(false)`, the readers keep holding. So also when one reader is the writer's own
/// `RwLock` (the same owner id, and the token its write recorded): the hold id `status` showed tells
/// the writer's node from the reader's. Without the hold id (a holder built by hand) that reader
/// cannot be told from the writer, and the break is refused as aimed at a reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_writer_break_while_readers_hold_breaks_nothing() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let holder = locks_on(&backend_at(&server.url()).await);
    let other = locks_on(&backend_at(&server.url()).await);
    let operator = locks_on(&backend_at(&server.url()).await);
    let name = name("break_stale_writer");
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
    assert_eq!(children(&raw, &name).await.len(), 1);

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
    assert_eq!(children(&raw, &name).await.len(), 2);
    tokio::time::sleep(Duration::from_millis(300)).await;
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

/// A writer is an exclusive holder: broken as a mutex holder is, its token recorded in the name
/// node (in the same `multi` as the delete) as its release would, and the reader behind it gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_writer_records_its_token_and_lets_the_reader_in() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let holder = locks_on(&backend_at(&server.url()).await);
    let reader = locks_on(&backend_at(&server.url()).await);
    let operator = locks_on(&backend_at(&server.url()).await);
    let name = name("break_writer");
    let writing = holder.read_write(&name).unwrap().write().await.unwrap();
    let waiting = {
        let rw = reader.read_write(&name).unwrap();
        tokio::spawn(async move { rw.read().await })
    };
    wait_children(&raw, &name, 2).await;
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
    let (data, _) = raw.get_data(&format!("/{name}")).await.unwrap();
    let recorded = layout::parse_write_record(&data).map(|t| u64::try_from(t).unwrap());
    assert_eq!(recorded, info.token.map(|t| t.get()), "the write record");
    assert!(read.token() >= info.token);
    read.release().await.unwrap();
}

/// A Curator `InterProcessMutex` holder (another JVM, its IP address as the node's data) is broken
/// by what `status` shows of it, and distlock's waiter behind it gets the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_curator_holder_is_broken_and_the_distlock_waiter_gets_in() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let name = name("break_curator");
    let mut curator = Curator::hold(&connect, &name);
    curator.wait_acquired();
    let waiter = locks_on(&backend_at(&server.url()).await);
    let waiting = {
        let lock = waiter.lock(&name).unwrap();
        tokio::spawn(async move {
            let guard = lock.acquire().await;
            (lock, guard)
        })
    };
    let queued = wait_children(&raw, &name, 2).await;
    let info = shown(&waiter, &name).await;
    assert!(waiter.break_holder(&name, &info).await.expect("break"));
    let (_lock, next) = tokio::time::timeout(PROMPT, waiting)
        .await
        .expect("the waiter gets the lock Curator held")
        .unwrap();
    let next = next.expect("acquire");
    assert!(next.token() > info.token);
    assert_eq!(children(&raw, &name).await, queued[1..].to_vec());
    next.release().await.unwrap();
    drop(curator);
}
