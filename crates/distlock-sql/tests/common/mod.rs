//! Cases shared by the PostgreSQL and MariaDB attack tests.

use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, Locks};

/// One round of "a wait given up in the server never takes the lock later": `holder` holds `name`,
/// `waiter` gives up after `wait_ms`, and once the holder releases (after `abandon_bound`, the bound
/// of the background abandon) `third` takes the name within `slack`; the waiter's backend can still
/// lock another name. `server_state` describes the server for the failure message.
pub async fn cancelled_wait_round(
    [holder, waiter, third]: [&Locks; 3],
    name: &str,
    label: &str,
    wait_ms: u64,
    abandon_bound: Duration,
    slack: Duration,
    server_state: impl Fn() -> String,
) {
    let held = holder.lock(name).unwrap().acquire().await.unwrap();
    let got = waiter
        .lock(name)
        .unwrap()
        .options()
        .wait(Duration::from_millis(wait_ms))
        .acquire()
        .await;
    // `acquire`, not `try_acquire` (which ignores the wait limit): the wait must reach the
    // server and be given up there.
    let err = got
        .err()
        .unwrap_or_else(|| panic!("{label}: acquired while held"));
    assert_eq!(err.kind(), ErrorKind::Timeout, "{label}: {err}");
    tokio::time::sleep(abandon_bound).await;
    held.release().await.unwrap();
    let started = Instant::now();
    let taken = loop {
        if let Some(g) = third.lock(name).unwrap().try_acquire().await.unwrap() {
            break g;
        }
        assert!(
            started.elapsed() < slack,
            "{label}: the name stayed taken after its holder released it ({})",
            server_state()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // The waiter's backend (its pooled connections included) holds nothing; it can lock other names.
    let other = waiter
        .lock(&format!("attack/other/{}", uuid::Uuid::new_v4().simple()))
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("another name is free");
    other.release().await.unwrap();
    taken.release().await.unwrap();
}
