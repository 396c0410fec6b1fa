//! Large renewal batches (issue 9): a batch of more than `RENEWALS_PER_PIPELINE` renewals goes as
//! several pipelines sent back to back on the backend's one connection — all of them on the server
//! before any reply, so still one round trip per tick — and every reply is matched to its own lock.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::url::LockUrl;
use distlock_core::{LockGuard, LockState, Locks};
use distlock_redis::{layout, RedisBackend, RENEWALS_PER_PIPELINE};
use distlock_testkit::redis::{encode, RedisServer};
use redis::AsyncCommands;

/// Three full slices and a partial fourth.
const HOLDS: usize = 3 * RENEWALS_PER_PIPELINE + 7;

async fn locks(server: &RedisServer) -> Locks {
    let backend = RedisBackend::connect(&LockUrl::parse(&server.url()).unwrap())
        .await
        .expect("connect");
    Locks::new(backend)
}

async fn driver(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// `HOLDS` locks of one `Locks`, acquired at once (so their renewals fall into one batch).
async fn hold_many(locks: &Locks, case: &str, lease: Duration) -> Vec<(String, LockGuard)> {
    let run = uuid::Uuid::new_v4().simple().to_string();
    let names: Vec<String> = (0..HOLDS)
        .map(|i| format!("redis-test/{case}/{run}/{i}"))
        .collect();
    let acquires = names.iter().map(|name| {
        let lock = locks.lock(name).unwrap();
        async move { lock.options().lease(lease).acquire().await.unwrap() }
    });
    let guards = futures_util::future::join_all(acquires).await;
    names.into_iter().zip(guards).collect()
}

/// `CLIENT LIST`'s largest `qbuf` (bytes read from a client and not yet run).
async fn largest_query_buffer(admin: &mut redis::aio::MultiplexedConnection) -> usize {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(admin)
        .await
        .unwrap();
    list.lines()
        .filter_map(|line| {
            line.split(' ')
                .find_map(|field| field.strip_prefix("qbuf="))
                .and_then(|n| n.parse::<usize>().ok())
        })
        .max()
        .unwrap_or(0)
}

/// The slices of a batch are all sent before the first reply is awaited. The server's writes are
/// paused (`CLIENT PAUSE … WRITE` holds back every `EVALSHA` of a script that writes) over a renewal
/// tick: the batch's commands then wait, read but not run, in the connection's query buffer. One
/// slice at a time would leave at most one slice there (the next is sent only after its replies);
/// back to back, the whole batch is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slices_of_a_renewal_batch_are_all_on_the_server_before_any_reply() {
    let server = RedisServer::start_or_panic();
    let locks = locks(&server).await;
    let mut admin = driver(&server).await;
    // A 6 s lease: a tick every 2 s; a renewal waits up to 3 s for its replies, longer than the pause.
    let held = hold_many(&locks, "back-to-back", Duration::from_secs(6)).await;
    // Each renewal command's size on the wire, the owner read from the lock's hash.
    let sha = redis::Script::new(layout::RENEW).get_hash().to_string();
    let mut command_bytes = Vec::with_capacity(held.len());
    for (name, _) in &held {
        let owners: Vec<String> = admin.hkeys(name).await.unwrap();
        assert_eq!(owners.len(), 1, "{name} has one owner");
        command_bytes.push(
            encode(&[
                "EVALSHA",
                sha.as_str(),
                "1",
                name.as_str(),
                "6000",
                owners[0].as_str(),
            ])
            .len(),
        );
    }
    let slice_bytes: usize = {
        let mut sizes = command_bytes.clone();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        sizes.iter().take(RENEWALS_PER_PIPELINE).sum()
    };
    let smallest = command_bytes.iter().min().copied().unwrap();

    // Paused for longer than a tick, so one batch goes out during the pause.
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(2_300)
        .arg("WRITE")
        .query_async(&mut admin)
        .await
        .unwrap();
    let paused_at = Instant::now();
    let mut largest = 0;
    while paused_at.elapsed() < Duration::from_millis(2_200) {
        largest = largest.max(largest_query_buffer(&mut admin).await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Bytes of at least two slices and a half (the first command of the batch is parsed, and waits
    // outside the buffer): more than one slice at a time could ever leave there.
    let two_and_a_half_slices = (RENEWALS_PER_PIPELINE * 5 / 2) * smallest;
    assert!(
        largest >= two_and_a_half_slices && largest > slice_bytes,
        "the server held {largest} bytes of unrun commands during the pause; a batch of {HOLDS} \
         renewals sent back to back leaves ≥ {two_and_a_half_slices} (one slice is ≤ {slice_bytes})"
    );
    // The paused batch is answered after the pause, and every lock stays held.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    for (name, guard) in &held {
        assert_eq!(guard.state(), LockState::Held, "{name}");
    }
    for (_, guard) in held {
        guard.release().await.unwrap();
    }
}

/// What happened to a lock on the server behind its holder's back.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fate {
    Kept,
    Deleted,
    OtherType,
    OtherOwner,
}

/// Each renewal's reply goes to its own lock, across the slices of the batch: locks deleted, turned
/// into another type or taken by another owner on the server, spread over every slice, are lost with
/// their own reason, and every other lock stays held (and renewed on the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_renewal_of_a_sliced_batch_gets_its_own_outcome() {
    let server = RedisServer::start_or_panic();
    let locks = locks(&server).await;
    let mut admin = driver(&server).await;
    let lease = Duration::from_secs(3);
    let held = hold_many(&locks, "outcomes", lease).await;
    // Every 37th lock is meddled with, in turn each of the three ways: about 14 per slice.
    let fates: Vec<Fate> = (0..held.len())
        .map(|i| match (i % 37, (i / 37) % 3) {
            (0, 0) => Fate::Deleted,
            (0, 1) => Fate::OtherType,
            (0, 2) => Fate::OtherOwner,
            _ => Fate::Kept,
        })
        .collect();
    for ((name, _), fate) in held.iter().zip(&fates) {
        match fate {
            Fate::Kept => {}
            Fate::Deleted => {
                let _: () = admin.del(name).await.unwrap();
            }
            Fate::OtherType => {
                let _: () = admin.del(name).await.unwrap();
                let _: () = admin.set_ex(name, "x", 60).await.unwrap();
            }
            Fate::OtherOwner => {
                let _: () = admin.del(name).await.unwrap();
                let _: () = admin.hset(name, "someone-else:1", 1).await.unwrap();
                let _: () = admin.pexpire(name, 60_000).await.unwrap();
            }
        }
    }
    // Two ticks (one a second), so every lock has been renewed since.
    tokio::time::sleep(Duration::from_millis(2_400)).await;
    for ((name, guard), fate) in held.iter().zip(&fates) {
        let reason = guard.loss_reason().unwrap_or_default();
        let expected = match fate {
            Fate::Kept => {
                assert_eq!(guard.state(), LockState::Held, "{name}: {reason}");
                let pttl: i64 = admin.pttl(name).await.unwrap();
                // Acquired > 2.4 s ago with a 3 s lease: renewed, or it would have ≤ 0.6 s left.
                assert!(pttl > 1_000, "{name} was not renewed: pttl {pttl} ms");
                continue;
            }
            Fate::Deleted => "gone from the server",
            Fate::OtherType => "another type",
            Fate::OtherOwner => "another owner",
        };
        assert_eq!(guard.state(), LockState::Lost, "{name} ({fate:?})");
        assert!(
            reason.contains(expected),
            "{name} ({fate:?}) was lost for: {reason}"
        );
    }
    for ((_, guard), fate) in held.into_iter().zip(fates) {
        if fate == Fate::Kept {
            guard.release().await.unwrap();
        }
    }
}
