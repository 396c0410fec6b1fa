//! `lease` mode: the optimistic lock (not built yet).

use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, LockInfo, Released, RenewalId, Renewed};
use distlock_core::Result;

use super::{Inner, MysqlLease};
use crate::error::SqlError;

/// A held lease row.
#[derive(Debug)]
pub struct Held {}

fn unsupported() -> SqlError {
    SqlError::Unsupported(
        "?mode=lease is not built yet for MySQL/MariaDB; use ?mode=advisory".into(),
    )
}

pub(crate) async fn try_acquire(
    _inner: &Inner,
    _request: &AcquireRequest,
) -> Result<Attempt<MysqlLease>, SqlError> {
    Err(unsupported())
}

pub(crate) async fn wait(retry_after: Option<Duration>) {
    tokio::time::sleep(retry_after.unwrap_or(Duration::from_millis(50))).await;
}

pub(crate) async fn abandon(_inner: &Inner, _request: &AcquireRequest) {}

pub(crate) async fn renew(
    inner: &Inner,
    batch: &[(RenewalId, &str, &str, &Held, Duration)],
) -> Vec<(RenewalId, Result<Renewed>)> {
    batch
        .iter()
        .map(|(id, name, ..)| (*id, Err(inner.error(unsupported(), Some(name)))))
        .collect()
}

pub(crate) async fn release(
    _inner: &Inner,
    _held: &Held,
    _name: &str,
    _owner: &str,
) -> Result<Released, SqlError> {
    Err(unsupported())
}

pub(crate) async fn inspect(_inner: &Inner, _name: &str) -> Result<LockInfo, SqlError> {
    Err(unsupported())
}
