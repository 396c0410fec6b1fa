//! The waits that cannot wait in the server (a permit: no server wait fits "the first free of N keys";
//! lease mode: a row with an expiry) sleep until a release of their name is `NOTIFY`ed on the table's
//! channel, which the control connection `LISTEN`s to while such a waiter is registered
//! ([`Inner::listen`]), or until a nap passes.

use std::time::Duration;

use tokio::sync::broadcast;

use super::backend::{Inner, Listening};

/// One acquire's release notifications: subscribed and registered at its first wait.
#[derive(Debug, Default)]
pub(crate) struct Wakeups {
    receiver: Option<broadcast::Receiver<String>>,
    /// `None`: not registered yet, or the registration failed (the next wait tries again).
    listening: Option<Listening>,
}

impl Wakeups {
    /// Sleeps until a release of `name` is notified or `nap` passes. Returns at once instead (the
    /// caller tries again) when the control connection has only just begun to listen: at the first
    /// wait, or after it had closed or stopped listening, a release may have notified nobody. Without
    /// a registration (the control connection could not `LISTEN`), it sleeps the whole nap: `what`
    /// names the waits in the log line.
    pub(crate) async fn wait(&mut self, inner: &Inner, name: &str, nap: Duration, what: &str) {
        if self.listening.is_none() {
            // Subscribed before the LISTEN: nothing sent after it is missed.
            self.receiver = Some(inner.notify.subscribe());
            match inner.listen().await {
                Ok(listening) => {
                    self.listening = Some(listening);
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not LISTEN; {what} poll and register again next time");
                    self.receiver = None;
                }
            }
        } else {
            match inner.ensure_listening().await {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "the control connection does not LISTEN; {what} poll")
                }
            }
        }
        let Some(receiver) = self.receiver.as_mut() else {
            tokio::time::sleep(nap).await;
            return;
        };
        let _ = tokio::time::timeout(nap, async {
            loop {
                match receiver.recv().await {
                    Ok(payload) if payload == name => return,
                    Ok(_) => {}
                    // Missed some: one of them may have been ours.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
                }
            }
        })
        .await;
    }
}
