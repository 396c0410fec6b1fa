//! The connection to etcd and the requests on it: made again on the current runtime when the one it
//! was made on is gone, the sessions (one lease per TTL) and their keep-alive tasks, and idempotent
//! requests retried within the request timeout per the config's
//! [`connection.retry`](EtcdConfig::connection).

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{EtcdBackend, Inner};
use crate::config::EtcdConfig;
use crate::error::EtcdError;
use crate::rpc::pb::etcdserverpb::{
    LeaseGrantRequest, RangeRequest, RangeResponse, TxnRequest, TxnResponse,
};
use crate::rpc::Client;
use crate::session::Session;
use crate::tasks::Task;

/// The connection and the task that tells whether the runtime it was made on still runs (none when
/// it was made outside a runtime).
pub(crate) struct Conn {
    pub(crate) client: Client,
    pub(crate) sentinel: Option<Task>,
}

impl Conn {
    pub(crate) fn new(client: Client) -> Conn {
        Conn {
            client,
            sentinel: runtime_sentinel(),
        }
    }

    /// Whether the connection's runtime (and so its channel's tasks) still runs.
    fn is_alive(&self) -> bool {
        self.sentinel.as_ref().is_none_or(Task::is_alive)
    }
}

/// A task on the current runtime that does nothing: it is alive as long as the runtime a connection
/// was made on (and so the connection's own tasks) still runs.
fn runtime_sentinel() -> Option<Task> {
    tokio::runtime::Handle::try_current()
        .ok()
        .map(|runtime| Task::spawn(&runtime, std::future::pending::<()>()))
}

/// A session's keep-alive task (not alive once it is gone with its runtime).
pub(crate) struct Keeper {
    pub(crate) session: Arc<Session>,
    pub(crate) task: Task,
}

impl Keeper {
    pub(crate) fn spawn(runtime: &tokio::runtime::Handle, session: Arc<Session>) -> Keeper {
        let task = Task::spawn(runtime, session.clone().keep_alive_loop());
        Keeper { session, task }
    }
}

impl EtcdBackend {
    /// The connection, made again on the current runtime if the runtime it was made on is gone (its
    /// channel's tasks went with it); sessions, keep-alive tasks and the held-keys watch move to it.
    pub(crate) async fn connection(&self) -> std::result::Result<Client, EtcdError> {
        let live = |inner: &Inner| match inner.conn.lock() {
            Ok(conn) if conn.is_alive() => Some(conn.client.clone()),
            _ => None,
        };
        if let Some(client) = live(&self.inner) {
            return Ok(client);
        }
        let _serial = self.inner.reconnecting.lock().await;
        if let Some(client) = live(&self.inner) {
            return Ok(client);
        }
        let client = connect_client(&self.inner.config, "reconnect").await?;
        if let Ok(mut conn) = self.inner.conn.lock() {
            if let Some(old) = conn.sentinel.take() {
                old.abort();
            }
            *conn = Conn::new(client.clone());
        }
        tracing::debug!(
            "etcd: the connection's runtime was dropped; reconnected on the current one"
        );
        for session in self.inner.sessions.lock().await.values() {
            session.use_client(&client).await;
        }
        self.inner.held.use_client(&client);
        self.ensure_background();
        Ok(client)
    }

    /// Starts again, on the current runtime, the background tasks whose runtime was dropped: session
    /// keep-alives, the held-keys watch, the retry of failed deletes, the expiry of held locks.
    pub(crate) fn ensure_background(&self) {
        self.ensure_keepers();
        self.inner.held.keep_running();
        self.ensure_retrier();
        self.ensure_expiry();
    }

    /// Starts again, on the current runtime, the keep-alive tasks whose runtime was dropped.
    pub(crate) fn ensure_keepers(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if let Ok(mut keepers) = self.inner.keepers.lock() {
            for keeper in keepers.iter_mut() {
                if !keeper.task.is_alive() && keeper.session.gone_reason().is_none() {
                    *keeper = Keeper::spawn(&runtime, keeper.session.clone());
                }
            }
        }
    }

    /// The session for a lock of `lease`: TTL = the lease rounded up to whole seconds.
    pub(crate) async fn session_for(
        &self,
        lease: Duration,
    ) -> std::result::Result<Arc<Session>, EtcdError> {
        let secs = lease.as_secs() + u64::from(lease.subsec_nanos() > 0);
        let secs = secs.max(1);
        let client = self.connection().await?;
        let mut sessions = self.inner.sessions.lock().await;
        if let Some(s) = sessions.get(&secs) {
            if s.gone_reason().is_none() && !s.remaining().is_zero() {
                self.ensure_background();
                return Ok(s.clone());
            }
            // Known gone, or not confirmed within its TTL (keep-alives failed that long): the server
            // has expired it or will before long, so a key put on it now would be born dead. Retire it
            // (revoking it in case it lives on, so its keys go) and grant a new one.
            if s.gone_reason().is_none() {
                let _ = s.mark_gone("the session lease was not confirmed within its TTL");
                let retired = s.clone();
                tokio::spawn(async move { retired.revoke().await });
            }
        }
        // Retried like the other requests: a member that does not answer must not fail the acquire.
        // Not idempotent, but harmless: a lease granted by a send whose answer lost the race has no
        // keys and no keep-alives, and expires after its TTL.
        let ttl = i64::try_from(secs).unwrap_or(i64::MAX);
        let sent = distlock_core::clock::now();
        let resp = self
            .idempotent("lease grant", || {
                client.lease_grant(LeaseGrantRequest { ttl, id: 0 })
            })
            .await?;
        let session = Session::granted(
            &client,
            ttl,
            resp,
            sent,
            self.inner.config.connection.request_timeout,
            Arc::downgrade(&self.inner.expiries),
        )?;
        let runtime = tokio::runtime::Handle::current();
        if let Ok(mut keepers) = self.inner.keepers.lock() {
            keepers.retain(|k| {
                let live = k.session.gone_reason().is_none();
                if !live {
                    k.task.abort();
                }
                live
            });
            keepers.push(Keeper::spawn(&runtime, session.clone()));
        }
        sessions.insert(secs, session.clone());
        Ok(session)
    }

    pub(crate) async fn txn(
        &self,
        action: &'static str,
        txn: TxnRequest,
    ) -> std::result::Result<TxnResponse, EtcdError> {
        let client = self.connection().await?;
        // Every txn here is compare-guarded, so repeating one is harmless (the handoff's failure branch
        // reads its new key, so a copy that applied first is recognised: `hand_off_lease`).
        self.idempotent(action, || client.txn(txn.clone())).await
    }

    /// A txn whose reply may show that a send of it was *not* applied (a release whose compare
    /// failed), sent as [`txn`](Self::txn) is, but settled on a reply that `applied` accepts when one
    /// comes: a rejected reply waits for the other sends still under way (a hedged copy applied first
    /// makes the copy applied second fail its compare, and that one may answer first), and is not
    /// sent again. [`Settled::unsure`] says whether a send whose reply never came may have been
    /// applied, so that a rejected reply cannot be taken as "nothing was done".
    pub(crate) async fn txn_settled(
        &self,
        action: &'static str,
        txn: TxnRequest,
        applied: impl Fn(&TxnResponse) -> bool,
    ) -> std::result::Result<Settled<TxnResponse>, EtcdError> {
        let client = self.connection().await?;
        bounded_retry(
            &self.inner.config,
            action,
            self.inner.config.connection.request_timeout,
            || client.txn(txn.clone()),
            applied,
        )
        .await
    }

    pub(crate) async fn get(
        &self,
        action: &'static str,
        range: RangeRequest,
    ) -> std::result::Result<RangeResponse, EtcdError> {
        let client = self.connection().await?;
        self.idempotent(action, || client.range(range.clone()))
            .await
    }

    /// Runs an idempotent request within the request timeout, retried per the configured
    /// [`connection.retry`](EtcdConfig::connection) policy on failures other than a refusal of the
    /// credentials.
    /// Retrying rides over a connection that broke since the last request, or fails over to another
    /// endpoint: requests go to the endpoints in turn and a dead member's connection fails each
    /// request sent to it, so with several endpoints a few retries are needed to find a live one.
    pub(crate) async fn idempotent<T, F, Fut>(
        &self,
        action: &'static str,
        request: F,
    ) -> std::result::Result<T, EtcdError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, tonic::Status>>,
    {
        bounded_retry(
            &self.inner.config,
            action,
            self.inner.config.connection.request_timeout,
            request,
            |_| true,
        )
        .await
        .map(|settled| settled.reply)
    }
}

/// The reply a request settled on (see [`EtcdBackend::txn_settled`]).
pub(crate) struct Settled<T> {
    pub(crate) reply: T,
    /// Whether another send of the request may have been applied without its reply reaching us: one
    /// failed (a reset connection may have carried it to the server first), or one was still
    /// unanswered when the request settled. Only meaningful for a reply the caller rejected.
    pub(crate) unsure: bool,
}

/// Runs `request` until it succeeds, within `timeout` in all, retried per `config.connection.retry`
/// on failures other than a refusal of the credentials.
///
/// With several endpoints, an attempt that has not answered after a quarter of `timeout` is sent
/// again *without* being given up (it may still answer first; the first answer wins): a member that
/// stops answering without closing its connections (paused, overloaded, cut off by a firewall that
/// drops packets) keeps its connection open, and a request sent there waits until the HTTP/2 pings
/// give up on it (after which it is reconnected to at once). Without this, every request that landed
/// there would wait out the whole timeout and fail; the extra send goes to the next member (see
/// `Client::channel`). Each such extra send counts as a retry.
///
/// A reply that `accept` rejects (a compare-guarded write that found nothing to do) is not returned
/// while another send is under way: that one may be the send that did it (issue 24: a slow release
/// sent to a second member, the copy applied second answering first). It is kept, no more sends are
/// made, and it is returned once the others have answered or failed, or at the deadline, with
/// [`Settled::unsure`] set if any of them failed or never answered.
async fn bounded_retry<T, F, Fut>(
    config: &EtcdConfig,
    action: &'static str,
    timeout: Duration,
    request: F,
    accept: impl Fn(&T) -> bool,
) -> std::result::Result<Settled<T>, EtcdError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, tonic::Status>>,
{
    use futures_util::stream::{FuturesUnordered, StreamExt};
    use tokio::time::{sleep_until, Instant};

    let deadline = Instant::now() + timeout;
    let mut retries = config.connection.retry.start(Some(deadline));
    let hedge_after = hedge_after(config, timeout);
    // The sends under way: the first in place, the extra ones (hedged while it is unanswered) in a
    // `FuturesUnordered` made only when one is sent. A `FuturesUnordered` allocates a task the size of
    // the request's future (~2.5 KiB) at its making and another per push: two such blocks per request,
    // several requests per acquire, hundreds of acquires in flight, left holes the allocator kept
    // between held locks' blocks (issue 9's resident memory per held lock).
    let mut first = std::pin::pin!(Some(request()));
    let mut extra: Option<FuturesUnordered<Fut>> = None;
    let in_flight = |first: &Option<Fut>, extra: &Option<FuturesUnordered<Fut>>| {
        usize::from(first.is_some()) + extra.as_ref().map_or(0, FuturesUnordered::len)
    };
    let mut next_send = hedge_after.map(|after| Instant::now() + after);
    // A reply `accept` rejected, held while other sends are under way.
    let mut rejected: Option<T> = None;
    // A send failed: it may have reached the server before its connection broke.
    let mut failed = false;
    loop {
        let sending = in_flight(&first, &extra) > 0;
        if !sending {
            if let Some(reply) = rejected.take() {
                return Ok(Settled {
                    reply,
                    unsure: failed,
                });
            }
        }
        tokio::select! {
            answer = std::future::poll_fn(|cx| {
                if let Some(send) = first.as_mut().as_pin_mut() {
                    if let std::task::Poll::Ready(answer) = send.poll(cx) {
                        first.set(None);
                        return std::task::Poll::Ready(Some(answer));
                    }
                }
                match extra.as_mut() {
                    Some(extra) if !extra.is_empty() => extra.poll_next_unpin(cx),
                    _ => std::task::Poll::Pending,
                }
            }), if sending => {
                let status = match answer {
                    Some(Ok(reply)) if rejected.is_none() && !accept(&reply) => {
                        // Wait for the other sends (if any: the check at the loop's top returns it
                        // otherwise), and make no more.
                        rejected = Some(reply);
                        next_send = None;
                        continue;
                    }
                    Some(Ok(reply)) => {
                        if rejected.is_some() && !accept(&reply) {
                            continue;
                        }
                        return Ok(Settled { reply, unsure: false });
                    }
                    Some(Err(status)) => status,
                    None => continue,
                };
                tracing::debug!(action, error = %status, "etcd request failed");
                failed = true;
                if rejected.is_some() {
                    continue;
                }
                if !crate::error::retryable(&status) {
                    return Err(EtcdError::rpc(action)(status));
                }
                if in_flight(&first, &extra) > 0 {
                    // Another send of it is still under way.
                    continue;
                }
                let Some(delay) = retries.next_delay() else {
                    return Err(EtcdError::rpc(action)(status));
                };
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = sleep_until(deadline) => {}
                }
                first.set(Some(request()));
                next_send = hedge_after.map(|after| Instant::now() + after);
            }
            _ = sleep_until(next_send.unwrap_or(deadline)), if next_send.is_some() => {
                // Unanswered so far: send it once more, alongside, if a retry is left.
                next_send = match retries.next_delay() {
                    Some(_) => {
                        if first.is_none() {
                            first.set(Some(request()));
                        } else {
                            extra.get_or_insert_with(FuturesUnordered::new).push(request());
                        }
                        hedge_after.map(|after| Instant::now() + after)
                    }
                    None => None,
                };
            }
            _ = sleep_until(deadline) => {
                if let Some(reply) = rejected.take() {
                    // The other sends never answered: any of them may have been applied.
                    return Ok(Settled { reply, unsure: true });
                }
                return Err(EtcdError::Timeout {
                    action,
                    after: timeout,
                });
            }
        }
    }
}

/// How long a request bounded by `timeout` waits for its answer before it is sent again, alongside, to
/// the next member: a quarter of the bound, when there is another member to send it to. A member
/// that stopped answering without closing its connection (paused, or stalled) thus costs a request a
/// quarter of its bound, not all of it.
pub(crate) fn hedge_after(config: &EtcdConfig, timeout: Duration) -> Option<Duration> {
    (config.endpoints.len() > 1).then(|| timeout / 4)
}

/// Makes the client of `config` and proves within the connect timeout that a member answers (and
/// the credentials work): authenticates if needed, then one status call, retried per
/// `config.connection.retry` (requests go to the endpoints in turn, and one may land on a dead
/// member).
/// `action` names the attempt in a timeout error (`connect`, `reconnect`).
pub(crate) async fn connect_client(
    config: &EtcdConfig,
    action: &'static str,
) -> std::result::Result<Client, EtcdError> {
    let client = Client::new(config)?;
    let proved = bounded_retry(
        config,
        action,
        config.connection.connect_timeout,
        || async {
            if client.needs_token() {
                client.authenticate().await?;
            }
            client.status().await
        },
        |_| true,
    )
    .await;
    match proved {
        Ok(_) => Ok(client),
        Err(EtcdError::Rpc { source, .. }) => Err(EtcdError::Connect {
            endpoints: config.endpoints.join(","),
            source,
        }),
        Err(e) => Err(e),
    }
}
