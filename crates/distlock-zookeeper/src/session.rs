//! ZooKeeper sessions: one per distinct session timeout per backend (the lease of a lock picks its
//! session, as etcd's lease TTL picks its session lease), established lazily, replaced once expired,
//! and how a session's states map onto distlock's `Held`/`Jeopardy`/`Lost`:
//!
//! * `Disconnected`: requests fail with `ConnectionLoss`, so the renewal (a `sync` + `exists` of the
//!   own node) fails and the guard is `Jeopardy`; the session may live on;
//! * `SyncConnected` again within the session: the next renewal succeeds, the guard is `Held`;
//! * `Expired`, `Closed`, `AuthFailed`, or the own node deleted: the loss signal fires, `Lost`;
//!   a renewal that cannot be confirmed in time lets the core's deadline (from the negotiated
//!   timeout) make it `Lost` at the latest then, even when the client never hears of the expiry
//!   (CURATOR-206/604/696: never `Held` after the session could have expired).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use distlock_core::clock::{self, Instant};

use tokio::sync::Mutex as AsyncMutex;
use zookeeper_client as zk;

use crate::config::ZkConfig;
use crate::error::ZkError;
use crate::held::{self, HeldNodes};

/// One ZooKeeper session.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) client: zk::Client,
    /// False once the tokio runtime the session was connected on is gone: the client's I/O task ran
    /// there and died with it, so the session answers nothing any more (its nodes go when the server
    /// expires it).
    runtime_alive: Arc<AtomicBool>,
    /// Dropped with the session: ends its task (the runtime sentinel, which also watches the held
    /// nodes: `held.rs`).
    _sentinel: tokio::sync::oneshot::Sender<()>,
    /// The session's held nodes, watched by its task.
    pub(crate) held: Arc<HeldNodes>,
    /// The timeout the server negotiated.
    pub(crate) timeout: Duration,
    /// Deletes that got no answer, finished once the session is connected again (`cleanup`).
    pub(crate) cleanup: Mutex<crate::cleanup::Pending>,
    /// What is proven of the leader's last touch of the session (issue 10).
    leader_touch: Mutex<LeaderTouch>,
    /// How long after a request reached the follower the leader has surely heard of its touch.
    touch_report_lag: Duration,
}

impl Session {
    /// Whether the session is gone for good (expired, closed, refused): its ephemeral nodes are gone
    /// or going, and its client answers nothing any more.
    pub(crate) fn is_gone(&self) -> bool {
        !self.runtime_alive.load(Ordering::Acquire) || state_is_terminal(self.client.state())
    }

    /// Whether the runtime the session's I/O ran on is gone (the session may still live on the server
    /// until it expires there).
    pub(crate) fn runtime_gone(&self) -> bool {
        !self.runtime_alive.load(Ordering::Acquire)
    }

    /// A request sent at `sent_at` was answered through the leader (a `sync` or a write), just now: it
    /// proves the touches reported before it (see [`LeaderTouch`]).
    pub(crate) fn leader_confirmed(&self, sent_at: Instant) {
        lock(&self.leader_touch).confirmed(sent_at, clock::now(), self.touch_report_lag);
    }

    /// The TTL a grant or renewal confirmed by a request sent at `sent_at` may report: `asked`, cut so
    /// that the core's deadline (`≤ sent_at + ttl·0.99`) stays within `floor + timeout·0.99`, where
    /// `floor` is the proven lower bound of the leader's last touch. `None` when nothing is left: the
    /// leader may expire the session by then.
    pub(crate) fn leader_ttl(&self, asked: Duration, sent_at: Instant) -> Option<Duration> {
        let floor = lock(&self.leader_touch).floor();
        ttl_within(self.timeout, floor, asked, sent_at)
    }

    /// The send time of the newest request answered through the leader whose touch is not yet proven.
    fn newest_unproven(&self) -> Option<Instant> {
        lock(&self.leader_touch).newest_unproven()
    }

    /// A description of the session for messages.
    pub(crate) fn describe(&self) -> String {
        format!(
            "session 0x{:x} ({:?} timeout)",
            self.client.session_id().0,
            self.timeout
        )
    }
}

/// Whether a session state is terminal.
pub(crate) fn state_is_terminal(state: zk::SessionState) -> bool {
    matches!(
        state,
        zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
    )
}

/// The share of the session timeout trusted (the core's drift allowance: its deadlines are
/// `sent_at + ttl·0.99 − 2 ms`).
const DRIFT: f64 = 0.99;

/// The TTL to report for a confirmation sent at `sent_at`: the core's deadline `sent_at + ttl·0.99`
/// must not pass `floor + timeout·0.99`, the earliest time the leader may expire the session (it
/// touched it at or after `floor`, with its own clock, and expires it a timeout later). So
/// `ttl = (timeout·0.99 − (sent_at − floor)) / 0.99`, at most `asked` and the timeout; `None` when
/// nothing is left.
pub(crate) fn ttl_within(
    timeout: Duration,
    floor: Instant,
    asked: Duration,
    sent_at: Instant,
) -> Option<Duration> {
    let left = timeout
        .mul_f64(DRIFT)
        .checked_sub(sent_at.saturating_duration_since(floor))?;
    let ttl = left.div_f64(DRIFT).min(asked).min(timeout);
    (!ttl.is_zero()).then_some(ttl)
}

/// A lower bound of when the leader last touched a session (issue 10). A request a follower forwards
/// (`sync`, `create`) does not touch the session on the leader (`ZooKeeperServer.submitRequestNow`
/// touches the request's connection, which is null for a forwarded one); the follower only lists the
/// sessions it saw in its reply to the leader's next ping (`LearnerSessionTracker`'s touch table; the
/// leader pings every tickTime/2 from `Leader.lead`), and the leader then touches them with its own
/// clock. So a request answered at all proves the follower touched the session at or after its send
/// time `p`, but the leader's touch comes up to a ping interval later, or never if the follower lost the
/// leader meanwhile. It is proven once a request sent at `s ≥ a + lag`, where `a` is when `p`'s reply
/// arrived (the follower touched the session before answering, but maybe long after `p` was sent), is
/// answered through the leader: the follower's ping reply carrying `p` was on the same TCP stream before that forwarded request
/// (`lag` covers the wait for the ping). A session that moved to another server was revalidated by
/// the leader on reconnecting, which touches it then, later than any `p` answered before.
#[derive(Debug)]
pub(crate) struct LeaderTouch {
    /// The leader touched the session at or after this instant.
    floor: Instant,
    /// Send and reply times of requests answered through the leader whose touch is not yet proven,
    /// by send time, oldest first.
    unproven: VecDeque<(Instant, Instant)>,
    /// How long `unproven` may grow before it is thinned ([`MAX_UNPROVEN`]; unbounded in a test's
    /// reference).
    max_unproven: usize,
}

/// Unproven confirmations kept per session. Past it the list is thinned (every other entry dropped,
/// the oldest and the newest kept), never cut at its old end: the oldest entries are the ones the next
/// confirmations prove. Dropping them instead (as before) stalled the floor for as long as more than
/// this many confirmations came per lag (a burst of grants: 2000 acquires in ~2.7 s, one `create`
/// each), so every hold's TTL shrank to nothing and all were reported Lost while held.
const MAX_UNPROVEN: usize = 64;

impl LeaderTouch {
    /// A session whose establishment was sent at `sent_at`: the leader creates a session (it is never
    /// created on a follower) and touches it then, with its own clock, after that send.
    pub(crate) fn new(sent_at: Instant) -> Self {
        Self {
            floor: sent_at,
            unproven: VecDeque::new(),
            max_unproven: MAX_UNPROVEN,
        }
    }

    /// The same rule with no cap on the unproven list: the reference a test compares the thinned list
    /// with.
    #[cfg(test)]
    fn unbounded(sent_at: Instant) -> Self {
        Self {
            max_unproven: usize::MAX,
            ..Self::new(sent_at)
        }
    }

    /// A request sent at `sent_at` was answered through the leader at `answered_at`: every unproven
    /// request answered at or before `sent_at − lag` is proven (the newest send time becomes the floor)
    /// and this one waits for a later proof. The lag counts from the reply, not the send: the follower
    /// touched the session when the request reached it, which only its reply bounds (a request delayed
    /// on its way reaches the follower right before the next one, with no leader ping in between).
    pub(crate) fn confirmed(&mut self, sent_at: Instant, answered_at: Instant, lag: Duration) {
        let proven_until = sent_at.saturating_sub(lag);
        let newest_proven = self
            .unproven
            .iter()
            .filter(|(_, answered)| *answered <= proven_until)
            .map(|(sent, _)| *sent)
            .max();
        if let Some(newest_proven) = newest_proven {
            self.floor = self.floor.max(newest_proven);
        }
        let floor = self.floor;
        self.unproven
            .retain(|(sent, answered)| *sent > floor && *answered > proven_until);
        if sent_at <= self.floor {
            return;
        }
        let at = self.unproven.partition_point(|(p, _)| *p <= sent_at);
        if self.unproven.get(at.wrapping_sub(1)).map(|(p, _)| *p) != Some(sent_at) {
            self.unproven
                .insert(at, (sent_at, answered_at.max(sent_at)));
        }
        if self.unproven.len() > self.max_unproven {
            // Dropping an entry only proves less (the floor moves less), so any choice is safe; this
            // one keeps the span: the oldest (proven first) and the newest stay, the density halves.
            let last = self.unproven.len() - 1;
            let mut i = 0;
            self.unproven.retain(|_| {
                let keep = i % 2 == 0 || i == last;
                i += 1;
                keep
            });
        }
    }

    /// The proven lower bound of the leader's last touch.
    pub(crate) fn floor(&self) -> Instant {
        self.floor
    }

    /// The newest send time answered through the leader whose touch is not yet proven.
    fn newest_unproven(&self) -> Option<Instant> {
        self.unproven.back().map(|(sent, _)| *sent)
    }
}

/// How long after a follower saw a request the leader has surely processed the follower's report of
/// it: the leader pings every tickTime/2; ×1.5 for its loop overrunning on a loaded machine (the wait
/// starts after the previous round's work), + 50 ms for the ping's and the reply's trip and scheduling.
pub(crate) fn touch_report_lag(tick_time: Duration) -> Duration {
    (tick_time / 2).mul_f64(1.5) + Duration::from_millis(50)
}

/// The sessions of one backend (and its clones).
#[derive(Debug)]
pub(crate) struct Sessions {
    config: ZkConfig,
    connect_string: String,
    live: Mutex<Vec<Arc<Session>>>,
    /// Serialises session creation, so concurrent acquires with one lease share one session.
    connecting: AsyncMutex<()>,
    /// The timeout the server negotiated for the configured session timeout: the default lease.
    default_timeout: Mutex<Duration>,
}

impl Sessions {
    /// Establishes the default session (its negotiated timeout is the default lease).
    pub(crate) async fn connect(config: ZkConfig) -> Result<Sessions, ZkError> {
        config.check()?;
        let connect_string = config.connect_string()?;
        let sessions = Sessions {
            default_timeout: Mutex::new(config.session_timeout),
            connect_string,
            config,
            live: Mutex::new(Vec::new()),
            connecting: AsyncMutex::new(()),
        };
        let session = sessions.establish(sessions.config.session_timeout).await?;
        *lock(&sessions.default_timeout) = session.timeout;
        lock(&sessions.live).push(session);
        Ok(sessions)
    }

    pub(crate) fn config(&self) -> &ZkConfig {
        &self.config
    }

    /// Over the live sessions: holds recorded, and their task's watches in flight (a test hook).
    #[cfg(feature = "testing")]
    pub(crate) fn held_counts(&self) -> (usize, usize) {
        lock(&self.live)
            .iter()
            .fold((0, 0), |(records, watching), s| {
                (records + s.held.records(), watching + s.held.watching())
            })
    }

    /// The id and password of the live session with `timeout` (a test hook: a test takes the session
    /// over and closes it, as the server expiring it would end it).
    #[cfg(feature = "testing")]
    pub(crate) fn session_info(&self, timeout: Duration) -> Option<zk::SessionInfo> {
        lock(&self.live)
            .iter()
            .find(|s| s.timeout == timeout && !s.is_gone())
            .map(|s| s.client.session().clone())
    }

    /// The negotiated timeout of the default session.
    pub(crate) fn default_timeout(&self) -> Duration {
        *lock(&self.default_timeout)
    }

    /// A live session for a lock with `lease`: one whose negotiated timeout is the lease (the default
    /// session for the default lease), else a new one asking for it. A server that will not negotiate
    /// exactly that timeout makes the acquire fail: a lease is never silently changed.
    pub(crate) async fn for_lease(&self, lease: Duration) -> Result<Arc<Session>, ZkError> {
        let lease = round_to_millis(lease);
        if let Some(found) = self.find(lease) {
            return Ok(found);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(found) = self.find(lease) {
            return Ok(found);
        }
        let session = self.establish(lease).await?;
        if session.timeout != lease {
            let negotiated = session.timeout;
            drop(session); // the last client: closes the session
            return Err(ZkError::LeaseNotHonoured {
                asked: lease,
                negotiated,
            });
        }
        lock(&self.live).push(session.clone());
        Ok(session)
    }

    /// Any live session (for `inspect`), the default one when possible.
    pub(crate) async fn any(&self) -> Result<Arc<Session>, ZkError> {
        let default = self.default_timeout();
        if let Some(found) = self.find(default) {
            return Ok(found);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(found) = self.find(default) {
            return Ok(found);
        }
        let session = self.establish(self.config.session_timeout).await?;
        *lock(&self.default_timeout) = session.timeout;
        lock(&self.live).push(session.clone());
        Ok(session)
    }

    /// The live session with `timeout`, if any. Retires the sessions that are gone, and closes the idle
    /// ones of other leases than `timeout` and the default: no lock, acquire or pending delete uses them
    /// (only this list holds them), so a backend used with many leases over time keeps one idle session
    /// at most besides the default one, instead of one per lease ever used (ZooKeeper refuses a host's
    /// 61st connection by default).
    fn find(&self, timeout: Duration) -> Option<Arc<Session>> {
        let default = self.default_timeout();
        let mut live = lock(&self.live);
        live.retain(|s| {
            let idle = Arc::strong_count(s) == 1 && s.timeout != default && s.timeout != timeout;
            if idle {
                tracing::debug!(session = %s.describe(), "closing an idle session");
            }
            !s.is_gone() && !idle
        });
        live.iter().find(|s| s.timeout == timeout).cloned()
    }

    /// Connects a new session asking for `timeout`, adds the digest credentials and makes sure the
    /// chroot exists (created as a persistent node when absent).
    async fn establish(&self, timeout: Duration) -> Result<Arc<Session>, ZkError> {
        // The leader touches a new session after this (see `LeaderTouch::new`).
        let sent_at = clock::now();
        let mut connector = zk::Client::connector()
            .with_session_timeout(timeout)
            .with_connection_timeout(self.config.connection.connect_timeout);
        if let (Some(user), Some(password)) = (
            &self.config.connection.username,
            &self.config.connection.password,
        ) {
            connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
        }
        // The client tries the servers in turn until the session timeout (60 s by default) runs out;
        // the connect timeout bounds one attempt, so one try of each server is the bound (a server that
        // is down or refuses is reported then, not a session timeout later).
        let servers = u32::try_from(self.config.endpoints.len().max(1)).unwrap_or(u32::MAX);
        let bound = self
            .config
            .connection
            .connect_timeout
            .saturating_mul(servers);
        let connect = connector.connect(&self.connect_string);
        let client = match tokio::time::timeout(bound, connect).await {
            Ok(Ok(client)) => client,
            Ok(Err(source)) => {
                return Err(ZkError::Connect {
                    servers: self.connect_string.clone(),
                    source,
                })
            }
            Err(_) => {
                return Err(ZkError::Connect {
                    servers: self.connect_string.clone(),
                    source: zk::Error::Timeout,
                })
            }
        };
        let client = match &self.config.chroot {
            None => client,
            Some(chroot) => self.enter_chroot(client, chroot).await?,
        };
        let timeout_negotiated = client.session_timeout();
        let (runtime_alive, guard) = runtime_flag();
        let (sentinel, stopped) = tokio::sync::oneshot::channel::<()>();
        let held = Arc::new(HeldNodes::default());
        let watch_client = client.clone();
        tracing::debug!(
            session = client.session_id().0,
            asked = ?timeout,
            negotiated = ?timeout_negotiated,
            "ZooKeeper session established"
        );
        // Unless set, the largest tickTime a server with ZooKeeper's default `minSessionTimeout`
        // (2 ticks, which the negotiated timeout is clamped to at least) can have with this timeout.
        let tick_time = self.config.tick_time.unwrap_or(timeout_negotiated / 2);
        let session = Arc::new(Session {
            client,
            runtime_alive,
            _sentinel: sentinel,
            held: held.clone(),
            timeout: timeout_negotiated,
            cleanup: Mutex::default(),
            leader_touch: Mutex::new(LeaderTouch::new(sent_at)),
            touch_report_lag: touch_report_lag(tick_time),
        });
        let watcher = held::Watcher {
            held,
            client: watch_client,
            session: Arc::downgrade(&session),
            config: self.config.clone(),
            describe: session.describe(),
        };
        tokio::spawn(async move {
            // Cleared when the runtime drops this task.
            let _guard = guard;
            held::run(watcher, stopped).await;
        });
        spawn_touch_keeper(Arc::downgrade(&session), &self.config);
        Ok(session)
    }

    async fn enter_chroot(&self, client: zk::Client, chroot: &str) -> Result<zk::Client, ZkError> {
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let bound = self.config.connection.request_timeout;
        match tokio::time::timeout(bound, client.mkdir(chroot, &options)).await {
            Ok(Ok(())) => {}
            Ok(Err(source @ (zk::Error::NoChildrenForEphemerals | zk::Error::BadArguments(_)))) => {
                return Err(ZkError::Config(format!(
                    "the chroot {chroot:?} cannot be created ({source}): pick another chroot"
                )))
            }
            Ok(Err(source)) => {
                return Err(ZkError::Request {
                    action: "create of the chroot",
                    source,
                })
            }
            Err(_) => {
                return Err(ZkError::Timeout {
                    action: "create of the chroot",
                    after: bound,
                })
            }
        }
        client
            .chroot(chroot.to_string())
            .map_err(|_| ZkError::Config(format!("the chroot {chroot:?} is not a valid path")))
    }
}

/// Keeps the proven leader touch recent while nothing else does (a session with no held lock, a waiter):
/// a `sync` through the leader at once, then every timeout/6 unless another request answered through
/// the leader in the last timeout/6 still waits for its proof. A touch is proven only by a confirmation
/// a lag (≈ 0.4·timeout by default) after it, so without one soon after the establishment a lock granted
/// then would see its TTL shrink to nothing before any proof came; and a grant on a session idle for
/// longer than its timeout would have no proven touch within the timeout. Ends with the session.
fn spawn_touch_keeper(session: Weak<Session>, config: &ZkConfig) {
    let Some(period) = session.upgrade().map(|s| keeper_period(s.timeout)) else {
        return;
    };
    let bound = config.connection.request_timeout.min(period);
    tokio::spawn(async move {
        loop {
            {
                let Some(session) = session.upgrade() else {
                    return;
                };
                if session.is_gone() {
                    return;
                }
                let recent = session
                    .newest_unproven()
                    .is_some_and(|p| clock::now().saturating_duration_since(p) < period);
                if session.client.state() == zk::SessionState::SyncConnected && !recent {
                    let sent_at = clock::now();
                    if let Ok(Ok(())) = tokio::time::timeout(bound, session.client.sync("/")).await
                    {
                        session.leader_confirmed(sent_at);
                    }
                }
            }
            // On the boot clock: after a suspend the touch is proven again at the resume.
            clock::sleep(period).await;
        }
    });
}

/// How often the touch keeper makes sure of a confirmation through the leader.
pub(crate) fn keeper_period(timeout: Duration) -> Duration {
    (timeout / 6).max(Duration::from_millis(10))
}

/// A flag that turns false when the current tokio runtime is dropped: the session's task holds the
/// guard, which clears the flag when the runtime drops the task. The task ends when the session's
/// sender is dropped (with the session).
fn runtime_flag() -> (Arc<AtomicBool>, ClearOnDrop) {
    let flag = Arc::new(AtomicBool::new(true));
    let guard = ClearOnDrop(flag.clone());
    (flag, guard)
}

/// Clears its flag when dropped.
struct ClearOnDrop(Arc<AtomicBool>);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// ZooKeeper session timeouts are whole milliseconds.
fn round_to_millis(d: Duration) -> Duration {
    let millis = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    Duration::from_millis(u64::try_from(millis).unwrap_or(u64::MAX))
}

/// Locks a std mutex, ignoring poisoning (the data are plain values, consistent at every unlock).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_confirmation_is_proven_only_by_one_sent_a_lag_later() {
        let t0 = clock::now();
        let lag = 100 * MS;
        let mut touch = LeaderTouch::new(t0);
        touch.confirmed(t0 + 10 * MS, t0 + 10 * MS, lag);
        // Answered through the leader 99 ms after p: the follower may not have been pinged in between.
        touch.confirmed(t0 + 109 * MS, t0 + 109 * MS, lag);
        assert_eq!(
            touch.floor(),
            t0,
            "promoted by a confirmation less than the lag later"
        );
        // 100 ms after p: the ping reply carrying p preceded it.
        touch.confirmed(t0 + 110 * MS, t0 + 110 * MS, lag);
        assert_eq!(touch.floor(), t0 + 10 * MS);
        // The newest proven one wins; the younger ones wait.
        touch.confirmed(t0 + 300 * MS, t0 + 300 * MS, lag);
        assert_eq!(touch.floor(), t0 + 110 * MS);
        assert_eq!(touch.newest_unproven(), Some(t0 + 300 * MS));
        // A confirmation of an old request (a slow reply) never moves the floor back.
        touch.confirmed(t0 + 50 * MS, t0 + 301 * MS, lag);
        assert_eq!(touch.floor(), t0 + 110 * MS);
    }

    /// A follower touches a session when the request reaches it, which may be long after it was sent
    /// (a stalled connection or server): only its reply bounds that time. A request sent a lag after
    /// the first one's send, but before the first one's reply plus the lag, may reach the follower
    /// right behind it with no leader ping in between, so it proves nothing about the first.
    #[test]
    fn a_slow_reply_is_proven_only_a_lag_after_it_arrived() {
        let t0 = clock::now();
        let lag = 100 * MS;
        let mut touch = LeaderTouch::new(t0);
        // p sent at 10 ms, its reply only at 200 ms (it reached the follower at some time in between).
        touch.confirmed(t0 + 10 * MS, t0 + 200 * MS, lag);
        // s sent at 150 ms (a lag after p's send, but p may have reached the follower just before s).
        touch.confirmed(t0 + 150 * MS, t0 + 210 * MS, lag);
        assert_eq!(
            touch.floor(),
            t0,
            "p promoted by a request sent before p's reply + lag"
        );
        // A request sent a lag after p's reply proves p (and not yet s).
        touch.confirmed(t0 + 300 * MS, t0 + 301 * MS, lag);
        assert_eq!(touch.floor(), t0 + 10 * MS);
        touch.confirmed(t0 + 311 * MS, t0 + 312 * MS, lag);
        assert_eq!(touch.floor(), t0 + 150 * MS);
    }

    #[test]
    fn the_unproven_list_is_bounded_and_sorted() {
        let t0 = clock::now();
        let lag = Duration::from_secs(10);
        let mut touch = LeaderTouch::new(t0);
        for i in (1..=200u32).rev() {
            touch.confirmed(t0 + i * MS, t0 + i * MS, lag);
        }
        assert!(touch.unproven.len() <= MAX_UNPROVEN);
        assert!(touch
            .unproven
            .iter()
            .zip(touch.unproven.iter().skip(1))
            .all(|(a, b)| a < b));
        touch.confirmed(t0 + lag + 200 * MS, t0 + lag + 200 * MS, lag);
        assert_eq!(touch.floor(), t0 + 200 * MS);
    }

    /// A burst of confirmations (one `create` per grant: 2000 acquires in ~2.7 s), far more than
    /// `MAX_UNPROVEN` per lag: the floor keeps up (within about two lags of the newest), as it did
    /// not when the oldest unproven entries were dropped first (the floor stayed at the session's
    /// establishment and every hold's TTL shrank to nothing: all Lost while held).
    #[test]
    fn a_burst_of_confirmations_keeps_the_floor_moving() {
        let t0 = clock::now();
        for lag in [200 * MS, touch_report_lag(Duration::from_millis(1500))] {
            let mut touch = LeaderTouch::new(t0);
            for i in 0..3000u32 {
                let sent = t0 + i * MS;
                touch.confirmed(sent, sent + 5 * MS, lag);
                assert!(touch.unproven.len() <= MAX_UNPROVEN);
                if sent > t0 + lag * 3 {
                    let behind = sent.saturating_duration_since(touch.floor());
                    assert!(
                        behind <= lag * 2 + 20 * MS,
                        "lag {lag:?}: the floor is {behind:?} behind after {i} ms"
                    );
                }
            }
        }
    }

    #[test]
    fn the_ttl_keeps_the_core_deadline_within_the_leader_expiry() {
        let floor = clock::now();
        let timeout = Duration::from_millis(600);
        for after in [0, 1, 100, 300, 590, 593] {
            let sent_at = floor + after * MS;
            let ttl = ttl_within(timeout, floor, Duration::MAX, sent_at).unwrap();
            let core_deadline = sent_at + ttl.mul_f64(DRIFT) - 2 * MS;
            assert!(
                core_deadline <= floor + timeout.mul_f64(DRIFT),
                "{after} ms"
            );
        }
        assert_eq!(
            ttl_within(timeout, floor, 100 * MS, floor + 10 * MS),
            Some(100 * MS)
        );
        assert_eq!(
            ttl_within(timeout, floor, Duration::MAX, floor),
            Some(timeout)
        );
        assert_eq!(
            ttl_within(timeout, floor, Duration::MAX, floor + 594 * MS),
            None
        );
        assert_eq!(
            ttl_within(timeout, floor, Duration::MAX, floor + timeout),
            None
        );
    }

    #[test]
    fn tick_time_guess_and_lag() {
        assert_eq!(
            touch_report_lag(Duration::from_secs(30)),
            Duration::from_millis(22_550)
        );
        assert_eq!(
            touch_report_lag(Duration::from_millis(300)),
            Duration::from_millis(275)
        );
    }

    /// The cadence the core settles into (it renews after a third of each reported TTL), with the
    /// touch keeper, a grant `idle` after the establishment, a round trip of `rtt` and renewals that go
    /// out `late` after they are due: every renewal reports a TTL, and is answered well before (a
    /// quarter TTL) the deadline the previous one set. Returns the TTLs reported.
    fn steady_state(
        timeout: Duration,
        idle: Duration,
        rtt: Duration,
        late: Duration,
    ) -> Vec<Duration> {
        let lag = touch_report_lag(timeout / 2);
        let keeper = keeper_period(timeout);
        let start = clock::now();
        let mut touch = LeaderTouch::new(start);
        let mut next_keeper = start;
        // The keeper's syncs due before `until` (skipped while a recent confirmation waits for proof).
        let mut keep_until = |touch: &mut LeaderTouch, until: Instant| {
            while next_keeper < until {
                if touch
                    .newest_unproven()
                    .is_none_or(|p| next_keeper.saturating_duration_since(p) >= keeper)
                {
                    touch.confirmed(next_keeper, next_keeper + rtt, lag);
                }
                next_keeper = next_keeper + keeper;
            }
        };
        // The grant: its create sent `idle` after the establishment, granted a round trip later.
        let mut sent = start + idle;
        keep_until(&mut touch, sent);
        touch.confirmed(sent, sent + rtt, lag);
        let mut ttl = ttl_within(timeout, touch.floor(), timeout, sent + rtt).unwrap();
        let mut ttls = vec![ttl];
        while sent < start + idle + timeout * 20 {
            let deadline = sent + ttl.mul_f64(DRIFT) - 2 * MS;
            let renew_at = sent + ttl / 3 + late;
            keep_until(&mut touch, renew_at);
            assert!(
                renew_at + rtt < deadline - ttl / 4,
                "a renewal due too close to its deadline: {timeout:?}, ttl {ttl:?}"
            );
            sent = renew_at;
            touch.confirmed(sent, sent + rtt, lag);
            ttl = ttl_within(timeout, touch.floor(), timeout, sent)
                .unwrap_or_else(|| panic!("a renewal in steady state unconfirmed at {timeout:?}"));
            ttls.push(ttl);
        }
        ttls
    }

    #[test]
    fn steady_state_renewals_stay_confirmed_at_the_default_and_the_test_timeouts() {
        for timeout in [
            Duration::from_secs(60),
            Duration::from_secs(40),
            2000 * MS,
            600 * MS,
        ] {
            for (idle, rtt, late) in [
                (Duration::ZERO, MS, Duration::ZERO),
                (timeout / 2, 20 * MS, 30 * MS),
                (timeout * 7 / 3, MS, Duration::ZERO),
                (timeout * 10, 20 * MS, 30 * MS),
            ] {
                let ttls = steady_state(timeout, idle, rtt, late);
                eprintln!(
                    "{timeout:?} idle {idle:?} rtt {rtt:?} late {late:?}: {:?} .. {:?}",
                    &ttls[..3],
                    &ttls[ttls.len() - 2..]
                );
                let settled = ttls.last().unwrap();
                assert!(
                    *settled >= timeout.mul_f64(0.4),
                    "{timeout:?}: settled at {settled:?}"
                );
            }
        }
        // The default timeout settles at 0.5–0.6 × timeout (renewals every timeout/6 to timeout/5).
        let settled = *steady_state(Duration::from_secs(60), Duration::ZERO, MS, Duration::ZERO)
            .last()
            .unwrap();
        assert!(
            settled > Duration::from_secs(29) && settled < Duration::from_secs(37),
            "{settled:?}"
        );
    }

    // ---- Review r-zkl: thinning the unproven list must never move the floor later than a real proof.

    /// A tiny deterministic PRNG (xorshift64*), so the property tests need no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    /// The safe bound itself, from every confirmation ever reported (no list, no cap, no dedup):
    /// the leader touched the session at or after `s_i` once a confirmation `i` (sent `s_i`,
    /// answered `a_i`) was followed by a reported confirmation sent at `≥ max(a_i, s_i) + lag`.
    struct Oracle {
        init: Instant,
        seen: Vec<(Instant, Instant)>,
        safe: Instant,
    }
    impl Oracle {
        fn confirmed(&mut self, sent_at: Instant, answered_at: Instant, lag: Duration) {
            let proven_until = sent_at.saturating_sub(lag);
            for &(s, a) in &self.seen {
                if a <= proven_until {
                    self.safe = self.safe.max(s);
                }
            }
            self.seen.push((sent_at, answered_at.max(sent_at)));
            self.safe = self.safe.max(self.init);
        }
    }

    /// The list's own invariants: bounded, strictly sorted by send time, every entry a confirmation
    /// really reported (send, `max(reply, send)`) and after the floor.
    fn check_list(
        touch: &LeaderTouch,
        seen: &std::collections::HashSet<(Instant, Instant)>,
        ctx: &str,
    ) {
        assert!(
            touch.unproven.len() <= MAX_UNPROVEN,
            "{ctx}: list over the cap"
        );
        assert!(
            touch
                .unproven
                .iter()
                .zip(touch.unproven.iter().skip(1))
                .all(|(a, b)| a.0 < b.0),
            "{ctx}: list not strictly sorted by send time"
        );
        for e in &touch.unproven {
            assert!(
                e.0 > touch.floor(),
                "{ctx}: an entry at or before the floor"
            );
            assert!(
                seen.contains(e),
                "{ctx}: an entry {e:?} never reported as such"
            );
        }
    }

    /// Random sequences (bursts far over `MAX_UNPROVEN` per lag, slow replies, replies out of send
    /// order, equal send times, sends before the establishment, replies before sends, calls in and out
    /// of reply order): the thinned floor never passes the floor the proof rule allows over every
    /// confirmation reported so far, and never passes the unbounded list's floor when send times are
    /// distinct. Also `newest_unproven` is the unbounded list's newest entry whenever the floors agree.
    fn thinned_vs_reference(seed: u64, steps: usize, distinct_sends: bool) -> (usize, usize) {
        let mut rng = Rng(seed | 1);
        // Far from the process's clock origin, so `saturating_sub` saturates only where asked to.
        let t0 = clock::now() + Duration::from_secs(3600);
        let lag = [MS, 7 * MS, 50 * MS, 100 * MS, 275 * MS][rng.below(5) as usize];
        let mut touch = LeaderTouch::new(t0);
        let mut unbounded = LeaderTouch::unbounded(t0);
        let mut oracle = Oracle {
            init: t0,
            seen: Vec::new(),
            safe: t0,
        };
        let density = 1 + rng.below(4); // mean spacing in units of 1/8 ms... up to 4 sends per ms
        let in_reply_order = rng.below(3) != 0;
        let mut cursor = t0;
        let mut now = t0;
        let mut used = std::collections::HashSet::new();
        let mut seen = std::collections::HashSet::new();
        let mut thinned = 0;
        let mut moved = 0;
        for step in 0..steps {
            cursor = cursor + Duration::from_micros(rng.below(density * 250));
            let mut sent = match rng.below(10) {
                // Out of order: sent up to 2 lags before the newest send (a slow pipeline).
                0 | 1 => cursor.saturating_sub(Duration::from_nanos(
                    rng.below(2 * lag.as_nanos() as u64 + 1),
                )),
                // Before the establishment (ignored by the rule).
                2 if step < 5 => t0.saturating_sub(Duration::from_micros(rng.below(1000))),
                // The same send time as an earlier one (a coarse clock, pipelined requests).
                3 if !distinct_sends && !oracle.seen.is_empty() => {
                    oracle.seen[rng.below(oracle.seen.len() as u64) as usize].0
                }
                _ => cursor,
            };
            if distinct_sends {
                while !used.insert(sent) {
                    sent = sent + Duration::from_nanos(1);
                }
            }
            let rtt = match rng.below(8) {
                0 => Duration::ZERO,
                1 => Duration::from_nanos(rng.below(3 * lag.as_nanos() as u64 + 1)), // slow
                2 if !in_reply_order => Duration::ZERO, // the reply stamped before the send (max)
                _ => Duration::from_micros(rng.below(2000)),
            };
            let mut answered = sent + rtt;
            if in_reply_order {
                // Real calls stamp `clock::now()` at the call: replies are reported in reply order.
                answered = answered.max(now);
                now = answered;
            } else if rng.below(10) == 0 {
                answered = sent.saturating_sub(MS); // a reply stamp before its send
            }
            let before = touch.unproven.len();
            let floor_before = touch.floor();
            touch.confirmed(sent, answered, lag);
            unbounded.confirmed(sent, answered, lag);
            oracle.confirmed(sent, answered, lag);
            seen.insert((sent, answered.max(sent)));
            if before == MAX_UNPROVEN && touch.unproven.len() < before {
                thinned += 1;
            }
            if touch.floor() > floor_before {
                moved += 1;
            }
            let safe = touch.floor() >= floor_before
                && touch.floor() <= oracle.safe
                && (!distinct_sends || touch.floor() <= unbounded.floor());
            let list_ok = touch.unproven.len() <= MAX_UNPROVEN
                && touch
                    .unproven
                    .iter()
                    .zip(touch.unproven.iter().skip(1))
                    .all(|(a, b)| a.0 < b.0)
                && touch
                    .unproven
                    .iter()
                    .all(|e| e.0 > touch.floor() && seen.contains(e));
            if safe && list_ok && step % 16 != 0 {
                // The full checks below (with their message) on every 16th step, or on a failure.
                continue;
            }
            let ctx = format!(
                "seed {seed}, step {step}, lag {lag:?}, sent +{:?}, answered +{:?}",
                sent.saturating_duration_since(t0),
                answered.saturating_duration_since(t0)
            );
            assert!(touch.floor() >= floor_before, "{ctx}: the floor moved back");
            assert!(
                touch.floor() <= oracle.safe,
                "{ctx}: the floor +{:?} passes the proven bound +{:?}",
                touch.floor().saturating_duration_since(t0),
                oracle.safe.saturating_duration_since(t0)
            );
            if distinct_sends {
                assert!(
                    touch.floor() <= unbounded.floor(),
                    "{ctx}: the thinned floor +{:?} passes the unbounded floor +{:?}",
                    touch.floor().saturating_duration_since(t0),
                    unbounded.floor().saturating_duration_since(t0)
                );
                if touch.floor() == unbounded.floor() {
                    assert_eq!(
                        touch.newest_unproven(),
                        unbounded.unproven.back().map(|e| e.0),
                        "{ctx}: newest_unproven differs from the unbounded list's"
                    );
                }
            }
            check_list(&touch, &seen, &ctx);
        }
        (thinned, moved)
    }

    #[test]
    fn review_thinned_floor_never_passes_the_unbounded_floor_or_the_proof() {
        let (mut thinned, mut moved) = (0, 0);
        for seed in 0..300u64 {
            let (t, m) =
                thinned_vs_reference(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5, 600, true);
            thinned += t;
            moved += m;
        }
        // The property is only worth something if thinning really happened, often.
        assert!(thinned > 1000, "thinning happened only {thinned} times");
        assert!(moved > 1000, "the floor moved only {moved} times");
    }

    #[test]
    fn review_thinned_floor_never_passes_the_proof_with_equal_send_times() {
        let (mut thinned, mut moved) = (0, 0);
        for seed in 0..300u64 {
            let (t, m) = thinned_vs_reference(
                seed.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ 0x94D0,
                600,
                false,
            );
            thinned += t;
            moved += m;
        }
        assert!(thinned > 1000, "thinning happened only {thinned} times");
        assert!(moved > 1000, "the floor moved only {moved} times");
    }

    /// Exactly at the cap nothing is dropped; one more thins to 33 (oldest, every other, newest);
    /// the dropped entries cannot be proven any more, the kept ones are proven exactly as before.
    #[test]
    fn review_thinning_at_64_and_65_keeps_genuine_entries_and_the_rule() {
        let t0 = clock::now() + Duration::from_secs(3600);
        let lag = 100 * MS;
        let mut touch = LeaderTouch::new(t0);
        for i in 1..=64u32 {
            touch.confirmed(t0 + i * MS, t0 + i * MS, lag);
        }
        assert_eq!(touch.unproven.len(), 64);
        touch.confirmed(t0 + 65 * MS, t0 + 65 * MS, lag);
        assert_eq!(touch.unproven.len(), 33); // indices 0, 2, .., 64 (the newest is even)
        assert_eq!(touch.unproven.front().unwrap().0, t0 + MS);
        assert_eq!(touch.newest_unproven(), Some(t0 + 65 * MS));
        assert!(touch.unproven.iter().all(|(s, a)| s == a));
        // A confirmation sent at 2 ms + lag proves the entry at 2 ms in the unbounded list; here 2 ms
        // was dropped: the floor may only reach 1 ms (never more than the rule allows).
        touch.confirmed(t0 + lag + 2 * MS, t0 + lag + 2 * MS, lag);
        assert_eq!(touch.floor(), t0 + MS);
        // Exactly a lag after 3 ms (kept): proven, floor 3 ms, not 4 ms (dropped, not yet provable).
        touch.confirmed(t0 + lag + 3 * MS, t0 + lag + 3 * MS, lag);
        assert_eq!(touch.floor(), t0 + 3 * MS);
        // One nanosecond short of a lag after 5 ms: not proven.
        touch.confirmed(
            t0 + lag + 5 * MS - Duration::from_nanos(1),
            t0 + lag + 6 * MS,
            lag,
        );
        assert_eq!(touch.floor(), t0 + 3 * MS);
    }

    /// A slow-reply entry next to fast younger ones: thinning drops some, keeps others; the kept slow
    /// one is still proven only a lag after its reply, never by a request a lag after its send.
    #[test]
    fn review_a_kept_slow_reply_is_still_proven_only_a_lag_after_it_arrived() {
        let t0 = clock::now() + Duration::from_secs(3600);
        let lag = 1000 * MS;
        let mut touch = LeaderTouch::new(t0);
        // The slow one first (index 0: kept by every thinning), answered 1.5 s after its send.
        touch.confirmed(t0 + MS, t0 + 1501 * MS, lag);
        // 399 fast younger ones (sent 2..=400 ms, answered 1 ms later), repeated thinning.
        for i in 2..=400u32 {
            touch.confirmed(t0 + i * MS, t0 + (i + 1) * MS, lag);
            assert!(touch.unproven.len() <= MAX_UNPROVEN);
        }
        assert_eq!(
            touch.unproven.front().copied(),
            Some((t0 + MS, t0 + 1501 * MS))
        );
        // Sent a lag after some fast one's reply, before the slow one's reply + lag: the floor moves
        // to a fast kept entry, and the slow one (sent earlier) is dropped as behind the floor —
        // harmless: the floor is a proven fast entry, later than the slow one's send.
        touch.confirmed(t0 + lag + 10 * MS, t0 + lag + 10 * MS, lag);
        let f = touch.floor();
        assert!(
            f <= t0 + 9 * MS,
            "floor +{:?}",
            f.saturating_duration_since(t0)
        );
        assert!(touch.unproven.iter().all(|(s, _)| *s > f));
    }

    /// A slow reply anywhere in the list, every younger one slow too (so nothing younger can be
    /// proven first and hide it): whether thinning keeps or drops it, the floor reaches its send only
    /// a lag after its reply, and never passes the newest entry proven by the rule.
    #[test]
    fn review_a_slow_reply_in_the_middle_is_proven_only_a_lag_after_its_reply() {
        let t0 = clock::now() + Duration::from_secs(3600);
        let lag = 100 * MS;
        for slow_at in [1u32, 2, 3, 32, 33, 63, 64, 65] {
            let mut touch = LeaderTouch::new(t0);
            for i in 1..=65u32 {
                let answered = if i >= slow_at {
                    t0 + (900 + i) * MS
                } else {
                    t0 + i * MS
                };
                touch.confirmed(t0 + i * MS, answered, lag);
            }
            assert!(touch.unproven.len() <= MAX_UNPROVEN);
            // A lag after every fast reply: only the fast (older) ones are proven.
            // (The probes answer late themselves, so no probe is proven by a later probe.)
            let late = t0 + Duration::from_secs(5);
            touch.confirmed(t0 + 165 * MS, late, lag);
            assert!(
                touch.floor() < t0 + slow_at * MS,
                "slow_at {slow_at}: {:?}",
                touch.floor().saturating_duration_since(t0)
            );
            // A nanosecond short of a lag after the slow reply: still not proven.
            let short = t0 + (1000 + slow_at) * MS - Duration::from_nanos(1);
            touch.confirmed(short, late, lag);
            assert!(
                touch.floor() < t0 + slow_at * MS,
                "slow_at {slow_at}: proven too early"
            );
            // Exactly a lag after it: the floor may reach its send, never past it.
            touch.confirmed(t0 + (1000 + slow_at) * MS, late, lag);
            assert!(
                touch.floor() <= t0 + slow_at * MS,
                "slow_at {slow_at}: past the slow entry"
            );
        }
    }

    /// Equal send times (a coarse clock, pipelined requests): thinning drops `(2 ms, slow reply)`, a
    /// second confirmation sent at the same instant with a faster reply is then kept where the
    /// unbounded list's dedup would have kept the slow one. The thinned floor then passes the
    /// unbounded list's (2 ms > 1 ms) — but only to a genuinely proven send (a request sent at 2 ms
    /// answered at 66 ms, and one sent at 166 ms ≥ 66 ms + lag): within the proof rule, so safe; the
    /// unbounded list is merely stricter than the rule there (it keeps the first-reported reply).
    #[test]
    fn review_equal_send_times_after_thinning_prove_only_genuinely() {
        let t0 = clock::now() + Duration::from_secs(3600);
        let lag = 100 * MS;
        let mut touch = LeaderTouch::new(t0);
        let mut unbounded = LeaderTouch::unbounded(t0);
        for i in 1..=65u32 {
            let answered = if i == 1 { t0 + MS } else { t0 + (300 + i) * MS };
            touch.confirmed(t0 + i * MS, answered, lag);
            unbounded.confirmed(t0 + i * MS, answered, lag);
        }
        assert!(
            !touch.unproven.iter().any(|(s, _)| *s == t0 + 2 * MS),
            "2 ms thinned away"
        );
        touch.confirmed(t0 + 2 * MS, t0 + 66 * MS, lag);
        unbounded.confirmed(t0 + 2 * MS, t0 + 66 * MS, lag);
        let late = t0 + Duration::from_secs(5);
        touch.confirmed(t0 + 166 * MS, late, lag);
        unbounded.confirmed(t0 + 166 * MS, late, lag);
        assert_eq!(unbounded.floor(), t0 + MS);
        assert_eq!(
            touch.floor(),
            t0 + 2 * MS,
            "proven by (2 ms, 66 ms) then 166 ms"
        );
        // Nothing later than 2 ms is proven before a lag after its reply (≥ 303 ms).
        touch.confirmed(t0 + 402 * MS, late, lag);
        assert_eq!(touch.floor(), t0 + 2 * MS);
    }
}
