//! Redlock's round trip and peer: a parallel `PING` to every node (the backend's own fan-out, the
//! requests polled together in one task, done when all answered) and rslock (the Rust Redlock crate)
//! on the same nodes.

use std::time::Duration;

use distlock::redis::redlock::{RedlockBackend, RedlockConfig};
use tokio::time::Instant;

use crate::error::Error;
use crate::harness::Cycler;

/// One parallel `PING` fan-out to every node: Redlock's engine round trip.
#[derive(Debug)]
pub struct RedlockPing {
    pub backend: RedlockBackend,
}

impl Cycler for RedlockPing {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        self.backend.ping_quorum().await?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        Ok(())
    }
}

/// The nodes as rslock takes them: `redis://[user:pass@]host:port` (`rediss://` with TLS).
pub fn rslock_uris(config: &RedlockConfig) -> Vec<String> {
    config.nodes.iter().map(|n| rslock_uri(config, n)).collect()
}

/// One node as rslock (and a plain redis-rs client) takes it.
pub fn rslock_uri(config: &RedlockConfig, node: &distlock_core::url::Endpoint) -> String {
    let c = &config.connection;
    let scheme = if c.tls { "rediss" } else { "redis" };
    let auth = match (&c.username, &c.password) {
        (Some(u), Some(p)) => format!("{u}:{p}@"),
        (None, Some(p)) => format!(":{p}@"),
        _ => String::new(),
    };
    format!("{scheme}://{auth}{node}")
}

/// rslock's acquire (its own retries: up to 3 tries 0–200 ms apart, again until `wait` ends) and
/// unlock, on a 30 s TTL.
pub struct Rslock {
    manager: rslock::LockManager,
    resource: String,
}

impl std::fmt::Debug for Rslock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rslock")
            .field("resource", &self.resource)
            .finish_non_exhaustive()
    }
}

impl Rslock {
    pub fn new(uris: &[String], resource: String) -> Self {
        Self {
            manager: rslock::LockManager::new(uris.to_vec()),
            resource,
        }
    }

    /// rslock on one server, through the baselines' own redis-rs client (its TLS and CA included).
    /// Clones of one such peer share the manager's one multiplexed connection.
    pub fn from_client(client: redis::Client, resource: String) -> Self {
        Self {
            manager: rslock::LockManager::from_clients(vec![client]),
            resource,
        }
    }

    /// Another resource on the same manager (and so the same connection).
    pub fn sharing(&self, resource: String) -> Self {
        Self {
            manager: self.manager.clone(),
            resource,
        }
    }
}

const RSLOCK_TTL: Duration = Duration::from_secs(30);

impl Cycler for Rslock {
    type Held = rslock::Lock;

    async fn acquire(&self, wait: Duration) -> Result<Option<rslock::Lock>, Error> {
        let deadline = Instant::now() + wait;
        loop {
            match self
                .manager
                .lock(self.resource.as_bytes(), RSLOCK_TTL)
                .await
            {
                Ok(lock) => return Ok(Some(lock)),
                Err(rslock::LockError::Unavailable) if Instant::now() < deadline => continue,
                Err(rslock::LockError::Unavailable) => return Ok(None),
                Err(e) => return Err(Error::unavailable(format!("rslock: {e}"))),
            }
        }
    }

    async fn release(&self, lock: rslock::Lock) -> Result<(), Error> {
        self.manager.unlock(&lock).await;
        Ok(())
    }
}
