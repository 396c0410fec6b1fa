//! Connections: one reconnecting command connection per [`Link`], resolved afresh (through Sentinel,
//! for a Sentinel topology) every time it is (re)made.
//!
//! redis-rs's multiplexed connection matches replies to requests in order; after a request timed out
//! its reply may still arrive and be taken for the next request's. So a connection whose request timed
//! out or failed with an I/O error is dropped, and the next request makes a new one.
//!
//! In Cluster, redis-rs neither resends a request nor follows a redirect by itself (its `retries` are
//! 0): [`Link::run`] does, so that it knows what was resent ([`Sent::resent`]) and can follow an `ASK`
//! the way Redis means it (see [`Conn::Asking`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo,
    Pipeline, RedisConnectionInfo, Value,
};

use distlock_core::retry::RetryPolicy;
use distlock_core::url::Endpoint;

use crate::config::{RedisConfig, Topology};
use crate::error::{needs_cluster_action, ClusterRefusal, RedisError};

/// A connection of any kind; cheap to clone (all multiplex).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
    /// A connection of its own to the Cluster node an `ASK` named: the target of a slot migration
    /// under way, which has some of the slot's keys already. That node serves the slot only to a
    /// command right after `ASKING` on the same connection, so every command goes as `ASKING` and the
    /// command, in one pipeline: no command of another request on the connection can come between
    /// them and take the `ASKING` (redis-rs's Cluster connection sends the two as separate requests).
    /// A connection of its own, because the target may be a node the Cluster connection does not
    /// know yet (a new master takes its first slots by migration, and `CLUSTER SLOTS` lists only the
    /// owners of slots).
    Asking(MultiplexedConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Asking(c) => Box::pin(asking_command(c, cmd)),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Asking(c) => Box::pin(asking_pipeline(c, pipeline, offset, count)),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) | Conn::Asking(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// The reply to one command sent after `ASKING`: a refused `ASKING` (an ACL without `+asking`) is the
/// command's error, as the command would otherwise run without it.
fn after_asking(asking: Value, reply: Value) -> redis::RedisResult<Value> {
    asking.extract_error()?;
    Ok(reply)
}

/// `ASKING` and `cmd`, in one pipeline (see [`Conn::Asking`]).
async fn asking_command(conn: &mut MultiplexedConnection, cmd: &Cmd) -> redis::RedisResult<Value> {
    let mut asked = Pipeline::with_capacity(2);
    asked.cmd("ASKING").add_command(cmd.clone());
    let mut replies = conn.req_packed_commands(&asked, 0, 2).await?.into_iter();
    match (replies.next(), replies.next()) {
        (Some(asking), Some(reply)) => after_asking(asking, reply),
        _ => Err((redis::ErrorKind::Client, "ASKING: a reply is missing").into()),
    }
}

/// Every command of `pipeline` after an `ASKING` of its own, in one pipeline (see [`Conn::Asking`]);
/// the replies as the Cluster connection gives them: a redirect (or `TRYAGAIN`) in any of them fails
/// the whole pipeline, for [`Link::run`] to handle. Not for transactions (distlock sends none).
async fn asking_pipeline(
    conn: &mut MultiplexedConnection,
    pipeline: &Pipeline,
    offset: usize,
    count: usize,
) -> redis::RedisResult<Vec<Value>> {
    let mut asked = Pipeline::with_capacity(2 * pipeline.len());
    for cmd in pipeline.cmd_iter() {
        asked.cmd("ASKING").add_command(cmd.clone());
    }
    let values = conn.req_packed_commands(&asked, 0, asked.len()).await?;
    let mut replies = Vec::with_capacity(pipeline.len());
    let mut values = values.into_iter();
    while let (Some(asking), Some(reply)) = (values.next(), values.next()) {
        let reply = after_asking(asking, reply)?;
        if let Value::ServerError(e) = &reply {
            if needs_cluster_action(e.kind()) {
                return Err(e.clone().into());
            }
        }
        replies.push(reply);
    }
    Ok(replies.into_iter().skip(offset).take(count).collect())
}

/// How to reach the servers: shared by the command links and the pub/sub hub.
pub(crate) struct Target {
    config: RedisConfig,
    /// Shown in messages: the address, the Sentinels and master, or the seed nodes.
    pub(crate) shown: String,
}

fn redis_info(config: &RedisConfig) -> RedisConnectionInfo {
    let mut info = RedisConnectionInfo::default().set_db(config.db);
    if let Some(user) = &config.connection.username {
        info = info.set_username(user);
    }
    if let Some(password) = &config.connection.password {
        info = info.set_password(password);
    }
    info
}

/// The CA certificates of [`connection.ca_file`](RedisConfig::connection), to trust instead of the
/// system roots; `None` without a CA file. Read on every connect, so a replaced file is picked up.
#[cfg(feature = "tls")]
fn certificates(config: &RedisConfig) -> Result<Option<redis::TlsCertificates>, RedisError> {
    let Some(path) = config
        .connection
        .ca_file
        .as_ref()
        .filter(|_| config.connection.tls)
    else {
        return Ok(None);
    };
    let pem = std::fs::read(path).map_err(|e| {
        RedisError::Config(format!(
            "cannot read the TLS CA file {} (ca_file, ?ca=): {e}",
            path.display()
        ))
    })?;
    if !pem
        .windows(b"-----BEGIN CERTIFICATE-----".len())
        .any(|w| w == b"-----BEGIN CERTIFICATE-----")
    {
        return Err(RedisError::Config(format!(
            "the TLS CA file {} (ca_file, ?ca=) holds no PEM certificate",
            path.display()
        )));
    }
    Ok(Some(redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    }))
}

fn addr(endpoint: &Endpoint, tls: bool) -> ConnectionAddr {
    let (host, port) = (endpoint.host().to_string(), endpoint.port());
    if tls {
        ConnectionAddr::TcpTls {
            host,
            port,
            insecure: false,
            tls_params: None,
        }
    } else {
        ConnectionAddr::Tcp(host, port)
    }
}

/// `a:1,b:2`.
fn joined(endpoints: &[Endpoint]) -> String {
    endpoints
        .iter()
        .map(Endpoint::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

impl Target {
    pub(crate) fn new(config: RedisConfig) -> Self {
        let shown = match &config.topology {
            Topology::Standalone { addr } => addr.to_string(),
            Topology::Sentinel { sentinels, master } => {
                format!("master {master:?} of Sentinels {}", joined(sentinels))
            }
            Topology::Cluster { nodes } => format!("Cluster nodes {}", joined(nodes)),
        };
        Self { config, shown }
    }

    pub(crate) fn config(&self) -> &RedisConfig {
        &self.config
    }

    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.config.topology, Topology::Cluster { .. })
    }

    fn connect_error(&self, source: redis::RedisError) -> RedisError {
        RedisError::Connect {
            target: self.shown.clone(),
            source,
        }
    }

    fn connect_timeout(&self, what: &'static str) -> RedisError {
        RedisError::Timeout {
            what,
            target: self.shown.clone(),
            after: self.config.connection.connect_timeout,
        }
    }

    /// A client for the data node: the standalone server, or the master Sentinel names now.
    pub(crate) async fn client(&self) -> Result<Client, RedisError> {
        let config = &self.config;
        match &config.topology {
            Topology::Standalone { addr: host } => {
                let info = addr(host, config.connection.tls)
                    .into_connection_info()
                    .map_err(|e| self.connect_error(e))?
                    .set_redis_settings(redis_info(config));
                #[cfg(feature = "tls")]
                if let Some(certs) = certificates(config)? {
                    return Client::build_with_tls(info, certs).map_err(|e| self.connect_error(e));
                }
                Client::open(info).map_err(|e| self.connect_error(e))
            }
            Topology::Sentinel { sentinels, master } => {
                let nodes: Vec<ConnectionInfo> = sentinels
                    .iter()
                    .map(|s| {
                        addr(s, false)
                            .into_connection_info()
                            .map_err(|e| self.connect_error(e))
                    })
                    .collect::<Result<_, _>>()?;
                let mut node_info = redis::sentinel::SentinelNodeConnectionInfo::default()
                    .set_redis_connection_info(redis_info(config));
                if config.connection.tls {
                    node_info = node_info.set_tls_mode(redis::TlsMode::Secure);
                }
                let mut sentinel = redis::sentinel::SentinelClient::build(
                    nodes,
                    master.clone(),
                    Some(node_info),
                    redis::sentinel::SentinelServerType::Master,
                )
                .map_err(|e| self.connect_error(e))?;
                match tokio::time::timeout(
                    config.connection.connect_timeout,
                    sentinel.async_get_client(),
                )
                .await
                {
                    Ok(Ok(client)) => Ok(client),
                    Ok(Err(e)) => Err(self.connect_error(e)),
                    Err(_) => Err(self.connect_timeout("asking the Sentinels for the master")),
                }
            }
            Topology::Cluster { .. } => Err(RedisError::Unsupported(
                "internal: a Cluster has no single client".into(),
            )),
        }
    }

    /// The longest a reply may take on a Cluster connection: the request bound, plus `wait_timeout`
    /// where a `WAIT` goes with the request (the requests bound themselves more tightly; this is
    /// redis-rs's own backstop, which would otherwise cut every `WAIT` longer than the request bound).
    fn response_timeout(&self) -> Duration {
        let config = &self.config;
        if config.wait_replicas > 0 {
            config.connection.request_timeout + config.wait_timeout
        } else {
            config.connection.request_timeout
        }
    }

    /// A standalone (or Sentinel master) connection has no response timeout of redis-rs's own: every
    /// request on it is bounded by the caller ([`Link::run`], the undo's and the settle's own bounds),
    /// which fires first anyway (it starts before redis-rs's would) and reports the same
    /// [`RedisError::Timeout`]. A second timer per request would only cost a timer-wheel insertion and
    /// removal on every request (issue 9).
    fn connection_config(&self) -> AsyncConnectionConfig {
        AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.config.connection.connect_timeout))
            .set_response_timeout(None)
    }

    /// A Cluster client builder for the seed nodes: TLS (and its CA), credentials and timeouts set.
    pub(crate) fn cluster_builder(
        &self,
        nodes: &[Endpoint],
    ) -> Result<redis::cluster::ClusterClientBuilder, RedisError> {
        let config = &self.config;
        let infos: Vec<ConnectionInfo> = nodes
            .iter()
            .map(|n| {
                addr(n, config.connection.tls)
                    .into_connection_info()
                    .map_err(|e| self.connect_error(e))
            })
            .collect::<Result<_, _>>()?;
        let mut builder = redis::cluster::ClusterClientBuilder::new(infos)
            .connection_timeout(config.connection.connect_timeout)
            .response_timeout(self.response_timeout());
        if let Some(user) = &config.connection.username {
            builder = builder.username(user);
        }
        if let Some(password) = &config.connection.password {
            builder = builder.password(password);
        }
        #[cfg(feature = "tls")]
        if let Some(certs) = certificates(config)? {
            builder = builder.certs(certs);
        }
        Ok(builder)
    }

    /// A new command connection. A Cluster connection never sends a request again by itself (after a
    /// redirect, or on a new node connection after an I/O error): [`Link::run`] does.
    pub(crate) async fn connect(&self) -> Result<Conn, RedisError> {
        let config = &self.config;
        if let Topology::Cluster { nodes } = &config.topology {
            let client = self
                .cluster_builder(nodes)?
                .retries(0)
                .build()
                .map_err(|e| self.connect_error(e))?;
            return match tokio::time::timeout(
                config.connection.connect_timeout * 2,
                client.get_async_connection(),
            )
            .await
            {
                Ok(Ok(c)) => Ok(Conn::Cluster(c)),
                Ok(Err(e)) => Err(self.connect_error(e)),
                Err(_) => Err(self.connect_timeout("connecting to the Cluster")),
            };
        }
        let client = self.client().await?;
        match tokio::time::timeout(
            config.connection.connect_timeout,
            client.get_multiplexed_async_connection_with_config(&self.connection_config()),
        )
        .await
        {
            Ok(Ok(c)) => Ok(Conn::Single(c)),
            Ok(Err(e)) => Err(self.connect_error(e)),
            Err(_) => Err(self.connect_timeout("connecting")),
        }
    }

    /// A [`Conn::Asking`] to the Cluster node at `address` (`host:port`, as an `ASK` names it), with
    /// the seeds' TLS (and CA) and credentials.
    async fn connect_asking(&self, address: &str) -> Result<Conn, RedisError> {
        let config = &self.config;
        let node = address
            .rsplit_once(':')
            .and_then(|(host, port)| Some(Endpoint::new(host, port.parse().ok()?)))
            .ok_or_else(|| {
                RedisError::Unsupported(format!(
                    "a Cluster node redirected a request to {address:?}, which is no host:port"
                ))
            })?;
        let shown = || format!("{} (the target of a slot migration)", node);
        let node_error = |source| RedisError::Connect {
            target: shown(),
            source,
        };
        let info = addr(&node, config.connection.tls)
            .into_connection_info()
            .map_err(node_error)?
            .set_redis_settings(redis_info(config));
        #[cfg(feature = "tls")]
        let client = match certificates(config)? {
            Some(certs) => Client::build_with_tls(info, certs),
            None => Client::open(info),
        };
        #[cfg(not(feature = "tls"))]
        let client = Client::open(info);
        let client = client.map_err(node_error)?;
        match tokio::time::timeout(
            config.connection.connect_timeout,
            client.get_multiplexed_async_connection_with_config(&self.connection_config()),
        )
        .await
        {
            Ok(Ok(c)) => Ok(Conn::Asking(c)),
            Ok(Err(e)) => Err(node_error(e)),
            Err(_) => Err(RedisError::Timeout {
                what: "connecting",
                target: shown(),
                after: config.connection.connect_timeout,
            }),
        }
    }
}

/// Tells whether the runtime a connection's driver task was spawned on still runs: a task on that
/// runtime holds the receiving end, and is dropped with its runtime. A connection from a runtime that
/// is gone cannot send anything (its driver is gone with it), so it is replaced before use rather than
/// found broken by a request (which would then count as sent and be retried).
struct RuntimeProbe(tokio::sync::oneshot::Sender<()>);

impl RuntimeProbe {
    /// A probe on the current runtime.
    fn here() -> Self {
        let (alive, watched) = tokio::sync::oneshot::channel::<()>();
        // Ends when the probe is dropped (the sender goes), or with its runtime.
        tokio::spawn(async move {
            let _ = watched.await;
        });
        Self(alive)
    }

    fn runtime_gone(&self) -> bool {
        self.0.is_closed()
    }
}

/// How often [`Link::run`] follows a Cluster `MOVED`: after 5–10 ms, doubling up to 80–160 ms, at most
/// 5 times, whatever [`connection.retry`](RedisConfig::connection) says. The `MOVED` makes the Cluster
/// connection refresh its slot map, and requests sent meanwhile wait for the refresh.
const MOVED: RetryPolicy =
    RetryPolicy::new(5, Duration::from_millis(10), Duration::from_millis(160));

/// How often [`Link::run`] sends a request again that a Cluster node refused without running it for
/// the moment (`TRYAGAIN`: a multi-key request whose keys a slot migration has split between two
/// nodes; `CLUSTERDOWN`, `LOADING`, …): after 10–20 ms, doubling up to 250–500 ms, for as long as the
/// request's own bound (its timeout) from its first send.
const UNSETTLED: RetryPolicy = RetryPolicy::new(
    u32::MAX,
    Duration::from_millis(20),
    Duration::from_millis(500),
);

/// How many `ASK`s [`Link::run`] follows for one request: the target of a migration never answers
/// `ASK` itself, so more than one means the cluster is being reshaped under the request.
const ASKS: u32 = 3;

/// What [`Link::run`] does with a Cluster `ASK` (a slot under migration, the request's key already on
/// the target), and with a `TRYAGAIN` (keys of one command split between the two nodes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ask {
    /// Send the whole request to the target, each command after `ASKING` ([`Conn::Asking`]): right
    /// for a request about one key (or one lock's keys, which Redis moves or refuses together). A
    /// `TRYAGAIN` is sent again where it came from, within the request's timeout.
    Follow,
    /// As [`Follow`](Self::Follow), but a `TRYAGAIN` is returned at once: a renewal, which the
    /// watchdog sends again at its next look anyway. Waiting here would hold up the whole batch (one
    /// future for every group): the other holds' renewals would go unconfirmed with it.
    FollowNoWait,
    /// Return the `ASK` or the `TRYAGAIN` to the caller: a pipeline about several keys, some of which
    /// may still be on the source (the target would run their commands on keys it does not have);
    /// the caller sends them key by key. A `TRYAGAIN` fails the whole pipeline (redis-rs's Cluster
    /// connection fails it with its first such value) when one command's keys are split: sent again
    /// whole, the others would wait for that one.
    Return,
}

/// What happened to a request [`Link::run`] sent.
#[derive(Default)]
pub(crate) struct Sent {
    /// The connection the request was last sent on. Kept by the caller, it keeps that connection open
    /// (even after the link replaced it) so that a later command can be ordered after the request:
    /// Redis runs one connection's commands in the order they arrive.
    pub(crate) conn: Option<Conn>,
    /// Whether the request was sent again after the connection broke under an earlier attempt, whose
    /// outcome is therefore unknown (it may have run, its reply lost with the connection). A request
    /// sent again after a node refused it without running it (a redirect, `TRYAGAIN`) is no resend.
    pub(crate) resent: bool,
}

/// A connection a [`Link`] keeps, with the generation it was made in.
struct Cached {
    generation: u64,
    conn: Conn,
    probe: Arc<RuntimeProbe>,
}

/// Which of a [`Link`]'s connections a request went on.
#[derive(Clone)]
enum Which {
    /// The link's connection, of this generation.
    Main(u64),
    /// The [`Conn::Asking`] to this address, of this generation.
    Asking(String, u64),
}

/// Where [`Link::run`] sends the next attempt.
enum Route {
    /// On the link's connection (in Cluster: to the node the slot map names).
    Main,
    /// After `ASKING`, to the node at this address (see [`Conn::Asking`]).
    Asking(String),
}

/// One reconnecting command connection.
pub(crate) struct Link {
    current: Mutex<Option<Cached>>,
    /// Cluster: the connections to the nodes an `ASK` named, by address (see [`Conn::Asking`]).
    asking: Mutex<HashMap<String, Cached>>,
    /// Only one task connects at a time; the others wait for its connection.
    connecting: tokio::sync::Mutex<()>,
    generation: AtomicU64,
}

/// The connection in `cached`, unless its runtime is gone (then it is dropped).
fn live(cached: &mut Option<Cached>) -> Option<(u64, Conn)> {
    if cached.as_ref().is_some_and(|c| c.probe.runtime_gone()) {
        tracing::debug!("the Redis connection's runtime is gone; reconnecting on this one");
        *cached = None;
    }
    cached.as_ref().map(|c| (c.generation, c.conn.clone()))
}

impl Link {
    pub(crate) fn new() -> Self {
        Self {
            current: Mutex::new(None),
            asking: Mutex::new(HashMap::new()),
            connecting: tokio::sync::Mutex::new(()),
            generation: AtomicU64::new(0),
        }
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Option<Cached>> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn asking(&self) -> std::sync::MutexGuard<'_, HashMap<String, Cached>> {
        self.asking
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The cached [`Conn::Asking`] to `address`, unless its runtime is gone.
    fn cached_asking(&self, address: &str) -> Option<(u64, Conn)> {
        let mut asking = self.asking();
        let mut entry = asking.remove(address);
        let live = live(&mut entry);
        if let Some(entry) = entry {
            asking.insert(address.to_string(), entry);
        }
        live
    }

    fn cache(&self, conn: &Conn) -> Cached {
        Cached {
            generation: self.generation.fetch_add(1, Ordering::SeqCst) + 1,
            conn: conn.clone(),
            probe: Arc::new(RuntimeProbe::here()),
        }
    }

    /// The current connection, made if there is none.
    pub(crate) async fn get(&self, target: &Target) -> Result<(u64, Conn), RedisError> {
        if let Some(c) = live(&mut self.current()) {
            return Ok(c);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(c) = live(&mut self.current()) {
            return Ok(c);
        }
        let conn = target.connect().await?;
        let cached = self.cache(&conn);
        let generation = cached.generation;
        *self.current() = Some(cached);
        Ok((generation, conn))
    }

    /// The [`Conn::Asking`] to `address`, made if there is none.
    async fn get_asking(&self, target: &Target, address: &str) -> Result<(u64, Conn), RedisError> {
        if let Some(c) = self.cached_asking(address) {
            return Ok(c);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(c) = self.cached_asking(address) {
            return Ok(c);
        }
        let conn = target.connect_asking(address).await?;
        let cached = self.cache(&conn);
        let generation = cached.generation;
        self.asking().insert(address.to_string(), cached);
        Ok((generation, conn))
    }

    /// Drops the connection `which` (if still current), so the next request on it reconnects.
    fn drop_conn(&self, which: &Which) {
        match which {
            Which::Main(generation) => {
                let mut current = self.current();
                if current
                    .as_ref()
                    .is_some_and(|c| c.generation == *generation)
                {
                    *current = None;
                }
            }
            Which::Asking(address, generation) => {
                let mut asking = self.asking();
                if asking
                    .get(address)
                    .is_some_and(|c| c.generation == *generation)
                {
                    asking.remove(address);
                }
            }
        }
    }

    /// Runs `request` on the current connection within `timeout`, replacing the connection when the
    /// request leaves it in an unknown state. A connection found broken (not one that timed out) is
    /// typically one that sat idle while the server restarted or failed over: the request is tried again
    /// on a fresh connection as [`connection.retry`](RedisConfig::connection) says (once by default),
    /// and `sent.resent` says so
    /// (the first attempt may have run). Every request distlock sends is safe to repeat for the same
    /// owner (acquire grants again, release and renew are owner-guarded, reads are reads), but a
    /// repeated release cannot tell "my first attempt deleted it" from "it was gone": the caller reads
    /// `sent.resent` for that. `sent.conn` is set before each attempt is sent, so it is right even if
    /// this future is dropped. What is retried is decided by [`RedisError::is_broken_connection`]
    /// (typed error kinds): a request that timed out, or that the server refused (`WRONGTYPE`,
    /// `NOPERM`, …), fails at once.
    ///
    /// In Cluster, a node that refused the request without running it is no failure of the request:
    /// a `MOVED` is followed once the slot map is refreshed ([`MOVED`]), an `ASK` and a `TRYAGAIN` as
    /// `ask` says, and a `CLUSTERDOWN` (or a `TRYAGAIN` under [`Ask::Follow`]) waits and tries again
    /// within `timeout` ([`UNSETTLED`]). None of them is a resend: `sent.resent` stays as it was.
    pub(crate) async fn run<T, F, Fut>(
        &self,
        target: &Target,
        what: &'static str,
        timeout: Duration,
        ask: Ask,
        mut request: F,
        sent: &mut Sent,
    ) -> Result<T, RedisError>
    where
        F: FnMut(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let mut resends = target.config().connection.retry.start(None);
        let mut moved = MOVED.start(None);
        let mut unsettled = UNSETTLED.start(Some(tokio::time::Instant::now() + timeout));
        let mut asks = 0;
        let mut route = Route::Main;
        loop {
            let result = self
                .attempt(target, what, timeout, &route, &mut request, sent)
                .await;
            let Err(e) = &result else {
                return result;
            };
            let refusal = target.is_cluster().then(|| e.cluster_refusal()).flatten();
            match refusal {
                Some(ClusterRefusal::Ask(address)) => {
                    if ask == Ask::Return || asks == ASKS {
                        return result;
                    }
                    asks += 1;
                    tracing::debug!(what, %address, "following a Cluster ASK: the slot is migrating, the key is on the target");
                    route = Route::Asking(address);
                }
                Some(ClusterRefusal::Moved) => {
                    if !moved.wait().await {
                        return result;
                    }
                    tracing::debug!(error = %e, what, "following a Cluster MOVED");
                    route = Route::Main;
                }
                Some(ClusterRefusal::TryAgain) if ask != Ask::Follow => return result,
                // Where it was refused: a `TRYAGAIN` on the target of a migration is asked again there.
                Some(ClusterRefusal::TryAgain | ClusterRefusal::Unsettled) => {
                    if !unsettled.wait().await {
                        return result;
                    }
                    tracing::debug!(error = %e, what, "a Cluster node refused the request for now; trying again");
                }
                None => {
                    if !(e.is_broken_connection() && resends.wait().await) {
                        return result;
                    }
                    sent.resent = true;
                    tracing::debug!(error = %e, what, "retrying a Redis request on a fresh connection");
                    route = Route::Main;
                }
            }
        }
    }

    /// One attempt of [`run`](Self::run) on `route`: the connection is replaced if the request left it
    /// in an unknown state.
    async fn attempt<T, F, Fut>(
        &self,
        target: &Target,
        what: &'static str,
        timeout: Duration,
        route: &Route,
        request: &mut F,
        sent: &mut Sent,
    ) -> Result<T, RedisError>
    where
        F: FnMut(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let (which, conn) = match route {
            Route::Main => {
                let (generation, conn) = self.get(target).await?;
                (Which::Main(generation), conn)
            }
            Route::Asking(address) => {
                let (generation, conn) = self.get_asking(target, address).await?;
                (Which::Asking(address.clone(), generation), conn)
            }
        };
        sent.conn = Some(conn.clone());
        let mut in_flight = InFlight {
            link: self,
            which: Some(which.clone()),
        };
        let outcome = tokio::time::timeout(timeout, request(conn)).await;
        in_flight.which = None;
        let result = match outcome {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(RedisError::Request {
                what,
                target: target.shown.clone(),
                source,
            }),
            Err(_) => Err(RedisError::Timeout {
                what,
                target: target.shown.clone(),
                after: timeout,
            }),
        };
        if let Err(e) = &result {
            if e.breaks_connection() {
                tracing::debug!(error = %e, "replacing the Redis connection");
                self.drop_conn(&which);
            }
        }
        result
    }
}

/// A request on a connection, until its reply arrives. If the caller drops the request first (a
/// cancelled acquire, a renewal batch the core gave up on), its reply may never come — a request lost
/// on the way is never answered — and redis-rs would then hand the *next* reply on that connection to
/// the dropped request, leaving every later request waiting. So the connection is replaced.
struct InFlight<'a> {
    link: &'a Link,
    which: Option<Which>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(which) = self.which.take() {
            tracing::debug!(
                "a request was dropped before its reply: replacing the Redis connection"
            );
            self.link.drop_conn(&which);
        }
    }
}
