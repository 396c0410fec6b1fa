//! Requests bounded by the request timeout and retried per the config's `RetryPolicy` when the
//! connection was lost mid-request (the client reconnects within the session). Only requests safe to
//! repeat go through here: reads, `sync`, deletes of the own node; the sequential create does not
//! (see `acquire.rs`: a lost create is found again by its protection prefix).

use std::future::Future;
use tokio::time::Instant;

use zookeeper_client as zk;

use crate::config::ZkConfig;
use crate::error::{retryable, ZkError};

/// Runs `op` until it succeeds, fails for good, or the request timeout is used up.
pub(crate) async fn retried<T, F, Fut>(
    config: &ZkConfig,
    action: &'static str,
    mut op: F,
) -> Result<T, ZkError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, zk::Error>>,
{
    let bound = config.connection.request_timeout;
    let deadline = Instant::now() + bound;
    let mut retries = config.connection.retry.start(Some(deadline));
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, op()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(source)) if retryable(&source) => match retries.next_delay() {
                Some(delay) => tokio::time::sleep(delay).await,
                None => return Err(ZkError::Request { action, source }),
            },
            Ok(Err(source)) => return Err(ZkError::Request { action, source }),
            Err(_) => {
                return Err(ZkError::Timeout {
                    action,
                    after: bound,
                })
            }
        }
    }
}

/// Runs `op` once, bounded by the request timeout.
pub(crate) async fn once<T, Fut>(
    config: &ZkConfig,
    action: &'static str,
    op: Fut,
) -> Result<T, ZkError>
where
    Fut: Future<Output = Result<T, zk::Error>>,
{
    let bound = config.connection.request_timeout;
    match tokio::time::timeout(bound, op).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(ZkError::Request { action, source }),
        Err(_) => Err(ZkError::Timeout {
            action,
            after: bound,
        }),
    }
}
