//! `row` mode: the pessimistic lock (not built yet).

use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Released, RenewalId, Renewed};

use super::advisory::Waiting;
use super::{Inner, MysqlLease};
use crate::error::SqlError;

/// A held row lock.
#[derive(Debug)]
pub struct Held {}

fn unsupported() -> SqlError {
    SqlError::Unsupported("?mode=row is not built yet for MySQL/MariaDB; use ?mode=advisory".into())
}

pub(crate) async fn try_acquire(
    _inner: &Inner,
    _waiting: &mut Waiting,
    _request: &AcquireRequest,
) -> Result<Attempt<MysqlLease>, SqlError> {
    Err(unsupported())
}

pub(crate) async fn wait(
    _inner: &Inner,
    _waiting: &mut Waiting,
    _request: &AcquireRequest,
) -> Result<(), SqlError> {
    Err(unsupported())
}

pub(crate) async fn abandon(_inner: &Inner, _waiting: Waiting) {}

pub(crate) async fn probe<'a>(
    _inner: &Inner,
    id: RenewalId,
    _held: &Held,
    name: &'a str,
    _ttl: Duration,
) -> (RenewalId, &'a str, Result<Renewed, SqlError>) {
    (id, name, Err(unsupported()))
}

pub(crate) async fn release(_inner: &Inner, _held: &Held) -> Result<Released, SqlError> {
    Err(unsupported())
}
