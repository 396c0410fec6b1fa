//! Waiting without polling: one pub/sub connection per backend, multiplexed over every waiting lock.
//!
//! A waiter [`register`](Hub::register)s the lock's channel (ref-counted per channel), then
//! [`Subscription::confirm`]s: the hub task sends `SUBSCRIBE` (`SSUBSCRIBE` in Cluster) and answers once
//! the server confirmed it. Only then does the waiter try again, so a release between its busy try and
//! the subscription is never missed. Every message on a channel bumps that channel's counter; a waiter
//! marks the counter seen before each try and wakes when it moves.
//!
//! After a (re)connect the hub resubscribes every registered channel and then bumps every counter, so
//! each waiter tries again (a release published while the connection was down is not lost: Redisson
//! issue 1763). In Cluster, a node that gives a slot up (`CLUSTER SETSLOT … NODE`, the end of a slot
//! migration or a failover's) unsubscribes its clients from the slot's sharded channels by itself (an
//! `sunsubscribe` push nobody asked for): the hub subscribes such a channel again, where the slot now
//! lives, and then bumps its counter, so its waiters try again (a release published on the new node
//! before the subscription is not lost either). The connection is re-resolved on every connect (the Sentinel master included). While it
//! is down, a confirmation fails at once and the waiter falls back on the holder's pttl until the next
//! connect wakes it.
//!
//! Dropping the last [`Subscription`] of a channel unsubscribes it; the hub handles subscribe and
//! unsubscribe requests in order, so an unsubscribe never undoes a later subscribe. A fair waiter's
//! own channel ([`Hub::register_lingering`]) is unsubscribed [`LINGER`] later instead, and not at all
//! if registered again by then: the same owner's next wait finds it subscribed, and a process that
//! exits while holding the lock it waited for sends no `UNSUBSCRIBE` (the shared release channels are
//! unsubscribed at once: their subscriber count is what `status` reports as waiters).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use distlock_core::retry::Backoff;
use futures_util::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use redis::cluster_async::ClusterConnection;
use redis::{PushInfo, PushKind, Value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::conn::Target;
use crate::error::RedisError;

/// The per-channel state: how many acquisitions wait on it, and the counter that wakes them.
struct Entry {
    refs: usize,
    wake: watch::Sender<u64>,
}

#[derive(Default)]
struct Shared {
    channels: Mutex<HashMap<String, Entry>>,
    /// Whether the hub has a live connection (see [`Hub::is_connected`]).
    connected: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.channels.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wake(&self, channel: &str) {
        if let Some(entry) = self.lock().get(channel) {
            entry.wake.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    fn wake_all(&self) {
        for entry in self.lock().values() {
            entry.wake.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    fn snapshot(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    fn contains(&self, channel: &str) -> bool {
        self.lock().contains_key(channel)
    }
}

/// How long a lingering channel stays subscribed after its last subscription is dropped.
const LINGER: Duration = Duration::from_secs(1);

enum Cmd {
    Subscribe(String, oneshot::Sender<Result<(), RedisError>>),
    Unsubscribe { channel: String, linger: bool },
}

/// The backend's pub/sub hub. The task behind it lives while the hub or any subscription does, and
/// while its runtime does: when that runtime is gone (a `Locks` used on one runtime, then on another),
/// the next request starts the task again on the caller's runtime.
pub(crate) struct Hub {
    shared: Arc<Shared>,
    task: Arc<Task>,
}

/// The hub task's command channel, and how to start it again.
struct Task {
    target: Arc<Target>,
    tx: Mutex<mpsc::UnboundedSender<Cmd>>,
}

impl Task {
    /// Sends to the hub task, starting it (again) on the current runtime if it is gone.
    fn send(&self, shared: &Arc<Shared>, cmd: Cmd) -> Result<(), Cmd> {
        let mut tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        if tx.is_closed() {
            // The task ended with its runtime (it ends otherwise only when the hub is dropped). An
            // unsubscribe needs no new task: a new task subscribes only what is registered.
            if matches!(cmd, Cmd::Unsubscribe { .. })
                || tokio::runtime::Handle::try_current().is_err()
            {
                return Err(cmd);
            }
            tracing::debug!("the redis pub/sub hub's runtime is gone; restarting it on this one");
            shared
                .connected
                .store(false, std::sync::atomic::Ordering::Relaxed);
            *tx = spawn(self.target.clone(), shared.clone());
        }
        tx.send(cmd).map_err(|e| e.0)
    }
}

fn spawn(target: Arc<Target>, shared: Arc<Shared>) -> mpsc::UnboundedSender<Cmd> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(run(target, shared, rx));
    tx
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("channels", &self.shared.lock().len())
            .finish()
    }
}

impl Hub {
    /// Starts the hub task (it connects on the first subscription).
    pub(crate) fn start(target: Arc<Target>) -> Self {
        let shared = Arc::new(Shared::default());
        let tx = spawn(target.clone(), shared.clone());
        Self {
            shared,
            task: Arc::new(Task {
                target,
                tx: Mutex::new(tx),
            }),
        }
    }

    /// Whether the hub holds a pub/sub connection now (for the `testing` hook).
    #[cfg(feature = "testing")]
    pub(crate) fn is_connected(&self) -> bool {
        self.shared
            .connected
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Registers interest in `channel`; no I/O. The subscription is seen from now on.
    pub(crate) fn register(&self, channel: String) -> Subscription {
        self.register_with(channel, false)
    }

    /// [`register`](Self::register), for a channel that stays subscribed for [`LINGER`] after its
    /// last subscription is dropped (see the [module](self)).
    pub(crate) fn register_lingering(&self, channel: String) -> Subscription {
        self.register_with(channel, true)
    }

    fn register_with(&self, channel: String, linger: bool) -> Subscription {
        let mut channels = self.shared.lock();
        let entry = channels.entry(channel.clone()).or_insert_with(|| Entry {
            refs: 0,
            wake: watch::channel(0).0,
        });
        entry.refs += 1;
        let mut rx = entry.wake.subscribe();
        rx.borrow_and_update();
        Subscription {
            channel,
            linger,
            shared: self.shared.clone(),
            task: self.task.clone(),
            rx,
        }
    }
}

/// One acquisition's interest in a channel.
pub(crate) struct Subscription {
    channel: String,
    /// Unsubscribed [`LINGER`] after the last subscription is dropped, not at once.
    linger: bool,
    shared: Arc<Shared>,
    task: Arc<Task>,
    rx: watch::Receiver<u64>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("channel", &self.channel)
            .finish()
    }
}

impl Subscription {
    /// Sends the subscribe and waits for the server's confirmation (or the hub's failure).
    pub(crate) async fn confirm(&self) -> Result<(), RedisError> {
        let (reply, answer) = oneshot::channel();
        self.task
            .send(&self.shared, Cmd::Subscribe(self.channel.clone(), reply))
            .map_err(|_| RedisError::Unsupported("the pub/sub hub has stopped".into()))?;
        answer.await.unwrap_or_else(|_| {
            Err(RedisError::Unsupported(
                "the pub/sub hub has stopped".into(),
            ))
        })
    }

    /// Forgets the messages so far: the next [`changed`](Self::changed) waits for a newer one.
    pub(crate) fn mark_seen(&mut self) {
        self.rx.borrow_and_update();
    }

    /// Resolves when a message arrived on the channel (or the connection was remade) since the last
    /// [`mark_seen`](Self::mark_seen).
    pub(crate) async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            // The entry is gone (cannot happen while we hold a ref); never spin.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut channels = self.shared.lock();
        if let Some(entry) = channels.get_mut(&self.channel) {
            entry.refs = entry.refs.saturating_sub(1);
            if entry.refs == 0 {
                channels.remove(&self.channel);
                // Sent under the lock, so the hub sees it before any later subscribe of this channel.
                let _ = self.task.send(
                    &self.shared,
                    Cmd::Unsubscribe {
                        channel: self.channel.clone(),
                        linger: self.linger,
                    },
                );
            }
        }
    }
}

/// The hub's connection of either kind.
enum PubConn {
    Single {
        sink: PubSubSink,
        stream: PubSubStream,
    },
    Cluster {
        conn: ClusterConnection,
        pushes: mpsc::UnboundedReceiver<PushInfo>,
    },
}

/// What the hub's connection said.
enum Event {
    Message(String),
    /// The server (re)confirmed a subscription after redis-rs reconnected by itself (Cluster).
    Resubscribed(String),
    /// The server unsubscribed the connection from a channel (Cluster: our own unsubscribe, or a
    /// node that gave the channel's slot up).
    Unsubscribed(String),
    Closed,
    Other,
}

impl PubConn {
    async fn connect(target: &Target) -> Result<Self, RedisError> {
        let config = target.config();
        let timeout = config.connection.connect_timeout;
        let shown = || target.shown.clone();
        if let crate::config::Topology::Cluster { nodes } = &config.topology {
            let (push_tx, pushes) = mpsc::unbounded_channel();
            // The same seeds, TLS (and CA) and credentials as the command connections.
            let builder = target
                .cluster_builder(nodes)?
                .use_protocol(redis::ProtocolVersion::RESP3)
                .push_sender(push_tx);
            let client = builder.build().map_err(|source| RedisError::Connect {
                target: shown(),
                source,
            })?;
            let conn = tokio::time::timeout(timeout * 2, client.get_async_connection())
                .await
                .map_err(|_| RedisError::Timeout {
                    what: "pub/sub connect",
                    target: shown(),
                    after: timeout * 2,
                })?
                .map_err(|source| RedisError::Connect {
                    target: shown(),
                    source,
                })?;
            return Ok(PubConn::Cluster { conn, pushes });
        }
        let client = target.client().await?;
        let pubsub = tokio::time::timeout(timeout, client.get_async_pubsub())
            .await
            .map_err(|_| RedisError::Timeout {
                what: "pub/sub connect",
                target: shown(),
                after: timeout,
            })?
            .map_err(|source| RedisError::Connect {
                target: shown(),
                source,
            })?;
        let (sink, stream) = pubsub.split();
        Ok(PubConn::Single { sink, stream })
    }

    async fn subscribe(&mut self, channels: &[String]) -> redis::RedisResult<()> {
        match self {
            PubConn::Single { sink, .. } => sink.subscribe(channels).await,
            PubConn::Cluster { conn, .. } => {
                // Sharded channels of different slots live on different nodes: one call each.
                for channel in channels {
                    conn.ssubscribe(channel).await?;
                }
                Ok(())
            }
        }
    }

    async fn unsubscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            PubConn::Single { sink, .. } => sink.unsubscribe(channel).await,
            PubConn::Cluster { conn, .. } => conn.sunsubscribe(channel).await,
        }
    }

    async fn next(&mut self) -> Event {
        match self {
            PubConn::Single { stream, .. } => match stream.next().await {
                Some(msg) => Event::Message(msg.get_channel_name().to_string()),
                None => Event::Closed,
            },
            PubConn::Cluster { pushes, .. } => match pushes.recv().await {
                Some(push) => {
                    let channel = match push.data.first() {
                        Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                        _ => return Event::Other,
                    };
                    match push.kind {
                        PushKind::Message | PushKind::SMessage => Event::Message(channel),
                        PushKind::SSubscribe | PushKind::Subscribe => Event::Resubscribed(channel),
                        PushKind::SUnsubscribe | PushKind::Unsubscribe => {
                            Event::Unsubscribed(channel)
                        }
                        _ => Event::Other,
                    }
                }
                None => Event::Closed,
            },
        }
    }
}

/// The pause between reconnects while the server is unreachable: 25–50 ms at first, doubling up to
/// 1–2 s; back to the start once connected.
fn reconnect_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(50), Duration::from_secs(2))
}

/// Handles one command while connected; `false` when the connection is broken.
async fn serve(conn: &mut PubConn, shared: &Shared, cmd: Cmd, io: Duration, shown: &str) -> bool {
    match cmd {
        Cmd::Subscribe(channel, reply) => {
            let result =
                tokio::time::timeout(io, conn.subscribe(std::slice::from_ref(&channel))).await;
            let (ok, answer) = match result {
                Ok(Ok(())) => (true, Ok(())),
                Ok(Err(source)) => (
                    false,
                    Err(RedisError::Request {
                        what: "SUBSCRIBE",
                        target: shown.to_string(),
                        source,
                    }),
                ),
                Err(_) => (
                    false,
                    Err(RedisError::Timeout {
                        what: "SUBSCRIBE",
                        target: shown.to_string(),
                        after: io,
                    }),
                ),
            };
            let _ = reply.send(answer);
            ok
        }
        Cmd::Unsubscribe { channel, .. } => {
            if shared.contains(&channel) {
                return true; // registered again since: keep it
            }
            matches!(
                tokio::time::timeout(io, conn.unsubscribe(&channel)).await,
                Ok(Ok(()))
            )
        }
    }
}

/// Subscribes again to a channel the server unsubscribed us from although a waiter is registered on
/// it (see the [module](self)), then wakes its waiters; `false` when the connection is broken.
async fn resubscribe(conn: &mut PubConn, shared: &Shared, channel: String, io: Duration) -> bool {
    if !shared.contains(&channel) {
        return true; // our own unsubscribe
    }
    tracing::debug!(%channel, "the server unsubscribed a channel someone waits on; subscribing again");
    match tokio::time::timeout(io, conn.subscribe(std::slice::from_ref(&channel))).await {
        Ok(Ok(())) => {
            shared.wake(&channel);
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(%channel, error = %e, "subscribing again failed; reconnecting");
            false
        }
        Err(_) => {
            tracing::warn!(%channel, "subscribing again got no answer in time; reconnecting");
            false
        }
    }
}

/// Sleeps until the first lingering unsubscribe is due, or for ever without one.
async fn linger_due(due: Option<tokio::time::Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}

fn refuse(cmd: Cmd, error: &RedisError) {
    if let Cmd::Subscribe(_, reply) = cmd {
        let _ = reply.send(Err(RedisError::Unsupported(format!(
            "the pub/sub connection is down: {error}"
        ))));
    }
}

async fn run(target: Arc<Target>, shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Cmd>) {
    let io = target.config().connection.request_timeout;
    let mut backoff = reconnect_backoff();
    // Connect only once someone waits (the loop's first step).
    let mut first = None;
    // Lingering channels' unsubscribes, each with when it is due (in the order they were asked for,
    // so the front is due first).
    let mut lingering: VecDeque<(tokio::time::Instant, String)> = VecDeque::new();
    loop {
        // Nobody subscribed and nothing asked: stay disconnected until someone waits again, rather than
        // reconnecting (and retrying against a server that is down) for no one.
        if first.is_none() && shared.snapshot().is_empty() {
            first = match rx.recv().await {
                Some(cmd) => Some(cmd),
                None => return,
            };
        }
        let mut conn = match PubConn::connect(&target).await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "redis pub/sub connection failed; retrying");
                if let Some(cmd) = first.take() {
                    refuse(cmd, &e);
                }
                let pause = tokio::time::sleep(backoff.next_delay());
                tokio::pin!(pause);
                loop {
                    tokio::select! {
                        _ = &mut pause => break,
                        cmd = rx.recv() => match cmd {
                            Some(cmd) => refuse(cmd, &e),
                            None => return,
                        },
                    }
                }
                continue;
            }
        };
        let channels = shared.snapshot();
        if !channels.is_empty() {
            match tokio::time::timeout(io, conn.subscribe(&channels)).await {
                Ok(Ok(())) => {}
                _ => {
                    tracing::warn!("redis pub/sub resubscribe failed; reconnecting");
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            }
        }
        backoff.reset();
        shared
            .connected
            .store(true, std::sync::atomic::Ordering::Relaxed);
        // Every waiter tries again: a release may have been published while we were away.
        shared.wake_all();
        // The connect's own subscribe just covered the first request if it is a subscribe of a
        // registered channel (a channel is registered before its subscribe is asked for, and nothing
        // was served in between): answered without a second `SUBSCRIBE`, one round trip per process's
        // first wait.
        let first = match first.take() {
            Some(Cmd::Subscribe(channel, reply)) if channels.contains(&channel) => {
                let _ = reply.send(Ok(()));
                None
            }
            other => other,
        };
        if let Some(cmd) = first {
            if !serve(&mut conn, &shared, cmd, io, &target.shown).await {
                continue;
            }
        }
        loop {
            tokio::select! {
                event = conn.next() => match event {
                    Event::Message(channel) | Event::Resubscribed(channel) => shared.wake(&channel),
                    Event::Unsubscribed(channel) => {
                        if !resubscribe(&mut conn, &shared, channel, io).await {
                            break;
                        }
                    }
                    Event::Other => {}
                    Event::Closed => break,
                },
                cmd = rx.recv() => match cmd {
                    Some(Cmd::Unsubscribe { channel, linger: true }) => {
                        lingering.push_back((tokio::time::Instant::now() + LINGER, channel));
                    }
                    Some(cmd) => {
                        if !serve(&mut conn, &shared, cmd, io, &target.shown).await {
                            break;
                        }
                    }
                    None => return,
                },
                () = linger_due(lingering.front().map(|(due, _)| *due)) => {
                    if let Some((_, channel)) = lingering.pop_front() {
                        // Not if registered again meanwhile (`serve` checks).
                        let cmd = Cmd::Unsubscribe { channel, linger: false };
                        if !serve(&mut conn, &shared, cmd, io, &target.shown).await {
                            break;
                        }
                    }
                }
            }
        }
        shared
            .connected
            .store(false, std::sync::atomic::Ordering::Relaxed);
        tracing::debug!("redis pub/sub connection lost");
    }
}
