//! Review of h-mem (issue 9, memory per held lock) on a real etcd: replies larger than the 512-byte
//! codec buffers, and the lazily made wake-ups of a hold (extend waiting for a renewal in flight,
//! `lost()` re-arming its timer).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{LockState, Locks};
use distlock_etcd::rpc::pb::etcdserverpb::{PutRequest, RangeRequest};
use distlock_etcd::rpc::Client;
use distlock_etcd::EtcdConfig;
use distlock_testkit::etcd::EtcdServer;

/// Replies far past 512 bytes: a holder and 12 waiters with 256-byte owner ids under a long name
/// (inspect reads them all), handed on in queue order; a raw range of ~100 KiB and a 64 KiB value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_mem_replies_past_the_codec_buffer() {
    let server = EtcdServer::start_or_panic();
    let name = format!("{}/{}", common::name("bigreply"), "n".repeat(180));
    let mut clients = Vec::new();
    for _ in 0..13 {
        clients.push(Locks::new(common::backend(&server.url()).await));
    }
    let owner = |i: usize| format!("{i:03}{}", "o".repeat(253));
    let first = clients[0]
        .lock_as(&name, owner(0))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let mut waiting = Vec::new();
    for (i, locks) in clients.iter().enumerate().skip(1) {
        let lock = locks.lock_as(&name, owner(i)).unwrap();
        waiting.push(tokio::spawn(async move {
            let g = lock.acquire().await.unwrap();
            let t = g.token();
            (i, g, t)
        }));
        // Queued (its key written) before the next is spawned, so the queue order is the spawn
        // order the hand-on below checks. A fixed pause was not enough under load: a new client's
        // first acquire (session lease, then its key) could take longer, two waiters swapped
        // places, and awaiting the one behind (whose turn never came while the one ahead held its
        // guard in its task's output) timed out.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let info = clients[0].inspect(&name).await.unwrap();
            if info.waiters == Some(i) {
                let holder = info.holder.unwrap();
                assert_eq!(holder.owner.as_deref(), Some(owner(0).as_str()));
                assert_eq!(holder.token, first.token());
                break;
            }
            assert!(
                Instant::now() < deadline,
                "waiter {i} not queued: waiters {:?}",
                info.waiters
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // A raw range over many large values.
    let raw = Client::connect(&EtcdConfig::new([server.endpoints()]))
        .await
        .unwrap();
    let prefix = format!("{name}-raw/");
    for i in 0..100 {
        raw.put(PutRequest {
            key: format!("{prefix}{i:03}").into_bytes(),
            value: vec![b'v'; 1000],
            ..PutRequest::default()
        })
        .await
        .unwrap();
    }
    raw.put(PutRequest {
        key: format!("{prefix}big").into_bytes(),
        value: vec![b'b'; 64 * 1024],
        ..PutRequest::default()
    })
    .await
    .unwrap();
    let mut end = prefix.clone().into_bytes();
    *end.last_mut().unwrap() += 1;
    let all = raw
        .range(RangeRequest {
            key: prefix.clone().into_bytes(),
            range_end: end,
            ..RangeRequest::default()
        })
        .await
        .unwrap();
    assert_eq!(all.kvs.len(), 101);
    assert!(all.kvs.iter().any(|kv| kv.value.len() == 64 * 1024));

    // Handed on in queue order, every token higher.
    let mut last = first.token();
    first.release().await.unwrap();
    for w in waiting {
        let (i, g, t) = tokio::time::timeout(Duration::from_secs(10), w)
            .await
            .expect("handed on")
            .unwrap();
        assert!(t > last, "waiter {i}: {t:?} after {last:?}");
        assert_eq!(g.owner(), owner(i));
        last = t;
        g.release().await.unwrap();
    }
}

/// Two `extend`s of one guard at once, repeatedly, while the watchdog renews a short lease: the one
/// that waits for the other's renewal in flight (the lazily made `renewal_done`) is woken, never
/// hangs. Meanwhile `lost()` and `jeopardy()` wait (the lazily made `deadline_moved`, re-armed at
/// every move); after the lease is revoked the loss is reported within a keep-alive interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_mem_concurrent_extends_never_hang_and_loss_is_prompt() {
    let server = EtcdServer::start_or_panic();
    let backend = common::backend(&server.url()).await;
    let locks = Locks::new(backend.clone());
    let lease = Duration::from_secs(3);
    let mut guards = Vec::new();
    for i in 0..4 {
        let g = locks
            .lock(&common::name(&format!("extends-{i}")))
            .unwrap()
            .options()
            .lease(lease)
            .acquire()
            .await
            .unwrap();
        guards.push(Arc::new(g));
    }
    let mut losts = Vec::new();
    for g in &guards {
        let g2 = g.clone();
        losts.push(tokio::spawn(async move { g2.lost().await }));
    }
    let until = Instant::now() + Duration::from_secs(4);
    let mut tasks = Vec::new();
    for g in &guards {
        for k in 0..3 {
            let g = g.clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u32;
                while Instant::now() < until {
                    let ttl = Duration::from_millis(2000 + 500 * k);
                    match tokio::time::timeout(Duration::from_secs(4), g.extend(ttl))
                        .await
                        .expect("an extend hung")
                    {
                        Ok(()) => n += 1,
                        // Unconfirmed in half the time left (documented): not a hang.
                        Err(e) if e.kind() == distlock_core::ErrorKind::Unavailable => {}
                        Err(e) => panic!("extend: {e}"),
                    }
                }
                n
            }));
        }
    }
    for t in tasks {
        assert!(t.await.unwrap() > 0);
    }
    for g in &guards {
        // Jeopardy is allowed: an extend unconfirmed in half the time left says so until the next.
        assert_ne!(g.state(), LockState::Lost, "{:?}", g.loss_reason());
    }
    for l in &losts {
        assert!(!l.is_finished(), "lost() resolved while held");
    }
    let (_, id) = backend.session_leases().await[0];
    let revoked_at = Instant::now();
    server
        .etcdctl(&["lease", "revoke", &format!("{id:x}")])
        .unwrap();
    for l in losts {
        tokio::time::timeout(lease / 3 + Duration::from_secs(2), l)
            .await
            .expect("Lost within one keep-alive interval")
            .unwrap();
    }
    assert!(revoked_at.elapsed() < lease, "only noticed at the deadline");
}

fn signal(server: &EtcdServer, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(server.pid() as i32).unwrap();
    rustix::process::kill_process(pid, sig).unwrap();
}

/// `lost()` armed for a 30 s lease, then an `extend(2 s)` moves the deadline nearer (the lazily made
/// `deadline_moved` wakes it to re-arm), then the only member is paused: Lost at the new deadline, not
/// the old one. A second guard's `lost()` first called after its move (its wake-ups made then) too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_review_mem_lost_rearms_when_an_extend_moves_the_deadline_nearer() {
    let server = EtcdServer::start_or_panic();
    let locks = Locks::new(common::backend(&format!("{}?request_timeout=10s", server.url())).await);
    let mut guards = Vec::new();
    for i in 0..2 {
        let g = locks
            .lock(&common::name(&format!("rearm-{i}")))
            .unwrap()
            .options()
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        guards.push(Arc::new(g));
    }
    let early = guards[0].clone();
    let early_lost = tokio::spawn(async move { early.lost().await });
    let early2 = guards[0].clone();
    let early_jeopardy = tokio::spawn(async move { early2.jeopardy().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    guards[0].extend(Duration::from_secs(2)).await.unwrap();
    guards[1].extend(Duration::from_secs(2)).await.unwrap();
    let moved_at = Instant::now();
    let late = guards[1].clone();
    let late_lost = tokio::spawn(async move { late.lost().await });
    signal(&server, rustix::process::Signal::STOP);
    let bound = Duration::from_secs(2) + Duration::from_millis(1500);
    let res = tokio::time::timeout(bound, async {
        early_lost.await.unwrap();
        late_lost.await.unwrap();
        early_jeopardy.await.unwrap();
    })
    .await;
    let elapsed = moved_at.elapsed();
    signal(&server, rustix::process::Signal::CONT);
    res.unwrap_or_else(|_| {
        panic!("lost() not resolved {elapsed:?} after the deadline moved to 2 s")
    });
    assert_eq!(guards[0].state(), LockState::Lost);
    assert_eq!(guards[1].state(), LockState::Lost);
}

/// One session holding 60 locks with long names; its lease revoked: one watch reply carries every
/// delete (far past 512 bytes), and every guard is Lost promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_mem_a_revoked_session_with_many_holds_loses_them_all_promptly() {
    let server = EtcdServer::start_or_panic();
    let backend = common::backend(&server.url()).await;
    let locks = Locks::new(backend.clone());
    let lease = Duration::from_secs(6);
    let mut guards = Vec::new();
    for i in 0..60 {
        let g = locks
            .lock(&format!(
                "{}/{}",
                common::name(&format!("many-{i}")),
                "k".repeat(150)
            ))
            .unwrap()
            .options()
            .lease(lease)
            .acquire()
            .await
            .unwrap();
        guards.push(Arc::new(g));
    }
    let leases = backend.session_leases().await;
    let revoked_at = Instant::now();
    for (_, id) in &leases {
        server
            .etcdctl(&["lease", "revoke", &format!("{id:x}")])
            .unwrap();
    }
    for g in &guards {
        tokio::time::timeout(Duration::from_secs(3), g.lost())
            .await
            .expect("Lost promptly");
    }
    assert!(
        revoked_at.elapsed() < lease - Duration::from_secs(2),
        "{:?}",
        revoked_at.elapsed()
    );
}

/// An `extend` cancelled at every stage (waiting for its turn, its request in flight) while another
/// waits for its turn: the waiter is always woken (the cancelled one's renewal ends as not sent or
/// abandoned), and the hold stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_mem_cancelled_extends_wake_the_waiting_one() {
    let server = EtcdServer::start_or_panic();
    let locks = Locks::new(common::backend(&server.url()).await);
    let g = Arc::new(
        locks
            .lock(&common::name("cancel-extend"))
            .unwrap()
            .options()
            .lease(Duration::from_secs(6))
            .acquire()
            .await
            .unwrap(),
    );
    let until = Instant::now() + Duration::from_secs(3);
    let canceller = {
        let g = g.clone();
        tokio::spawn(async move {
            let mut k = 0u64;
            while Instant::now() < until {
                let _ = tokio::time::timeout(
                    Duration::from_micros(100 * (k % 40)),
                    g.extend(Duration::from_secs(4)),
                )
                .await;
                k += 1;
                tokio::task::yield_now().await;
            }
            k
        })
    };
    let waiter = {
        let g = g.clone();
        tokio::spawn(async move {
            let mut ok = 0u32;
            while Instant::now() < until {
                match tokio::time::timeout(Duration::from_secs(4), g.extend(Duration::from_secs(5)))
                    .await
                    .expect("an extend waiting for its turn hung")
                {
                    Ok(()) => ok += 1,
                    Err(e) if e.kind() == distlock_core::ErrorKind::Unavailable => {}
                    Err(e) => panic!("extend: {e}"),
                }
            }
            ok
        })
    };
    assert!(canceller.await.unwrap() > 10);
    assert!(waiter.await.unwrap() > 0);
    g.extend(Duration::from_secs(5)).await.unwrap();
    assert_eq!(g.state(), LockState::Held);
}
