//! Connections: one reconnecting command connection per [`Link`], resolved afresh (through Sentinel,
//! for a Sentinel topology) every time it is (re)made.
//!
//! redis-rs's multiplexed connection matches replies to requests in order; after a request timed out
//! its reply may still arrive and be taken for the next request's. So a connection whose request timed
//! out or failed with an I/O error is dropped, and the next request makes a new one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo,
    RedisConnectionInfo,
};

use distlock_core::retry::RetryPolicy;
use distlock_core::url::Endpoint;

use crate::config::{RedisConfig, Topology};
use crate::error::RedisError;

/// A connection of either kind; cheap to clone (both multiplex).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
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

    /// A new command connection. `resends`: whether a Cluster connection may send a request again
    /// by itself (after a redirect, or on a new node connection after an I/O error); see [`Link`].
    pub(crate) async fn connect(&self, resends: bool) -> Result<Conn, RedisError> {
        let config = &self.config;
        if let Topology::Cluster { nodes } = &config.topology {
            let client = self
                .cluster_builder(nodes)?
                .retries(if resends { 2 } else { 0 })
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

/// How often [`Link::run`] follows a Cluster redirect on a link whose client does not (`MOVED`,
/// `ASK`): after 5–10 ms (the client refreshes its slot map meanwhile), at most 3 times, whatever
/// [`connection.retry`](RedisConfig::connection) says.
const REDIRECTS: RetryPolicy =
    RetryPolicy::new(3, Duration::from_millis(10), Duration::from_millis(40));

/// What happened to a request [`Link::run`] sent.
#[derive(Default)]
pub(crate) struct Sent {
    /// The connection the request was last sent on. Kept by the caller, it keeps that connection open
    /// (even after the link replaced it) so that a later command can be ordered after the request:
    /// Redis runs one connection's commands in the order they arrive.
    pub(crate) conn: Option<Conn>,
    /// Whether the request was sent again after the connection broke under an earlier attempt, whose
    /// outcome is therefore unknown (it may have run, its reply lost with the connection).
    pub(crate) resent: bool,
}

/// One reconnecting command connection.
pub(crate) struct Link {
    current: Mutex<Option<(u64, Conn, Arc<RuntimeProbe>)>>,
    /// Only one task connects at a time; the others wait for its connection.
    connecting: tokio::sync::Mutex<()>,
    generation: AtomicU64,
    /// Whether the Cluster client may resend a request by itself. redis-rs's Cluster connection resends
    /// a request whose node connection failed, out of [`Link::run`]'s sight: a release resent
    /// that way cannot be told from one that found nothing (`Sent::resent` stays false).
    resends: bool,
}

impl Link {
    pub(crate) fn new() -> Self {
        Self {
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            generation: AtomicU64::new(0),
            resends: true,
        }
    }

    /// A link whose requests are sent again only by [`run`](Self::run), which records
    /// it in [`Sent::resent`] (for releases, whose resend makes "not held" ambiguous).
    pub(crate) fn without_resends() -> Self {
        Self {
            resends: false,
            ..Self::new()
        }
    }

    /// The current connection, unless its runtime is gone (then it is dropped).
    fn cached(&self) -> Option<(u64, Conn)> {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current
            .as_ref()
            .is_some_and(|(_, _, probe)| probe.runtime_gone())
        {
            tracing::debug!("the Redis connection's runtime is gone; reconnecting on this one");
            *current = None;
        }
        current.as_ref().map(|(g, c, _)| (*g, c.clone()))
    }

    /// The current connection, made if there is none.
    pub(crate) async fn get(&self, target: &Target) -> Result<(u64, Conn), RedisError> {
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let conn = target.connect(self.resends).await?;
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        *self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some((generation, conn.clone(), Arc::new(RuntimeProbe::here())));
        Ok((generation, conn))
    }

    /// Drops the connection of `generation` (if still current), so the next request reconnects.
    pub(crate) fn invalidate(&self, generation: u64) {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.as_ref().is_some_and(|(g, _, _)| *g == generation) {
            *current = None;
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
    /// this future is dropped. What is retried is decided by [`RedisError::is_retryable`] (typed
    /// error kinds): a request that timed out, or that the server refused (`WRONGTYPE`, `NOPERM`, …),
    /// fails at once.
    pub(crate) async fn run<T, F, Fut>(
        &self,
        target: &Target,
        what: &'static str,
        timeout: Duration,
        mut request: F,
        sent: &mut Sent,
    ) -> Result<T, RedisError>
    where
        F: FnMut(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let mut retries = target.config().connection.retry.start(None);
        let mut redirects = REDIRECTS.start(None);
        loop {
            let result = self
                .attempt(target, what, timeout, &mut request, sent)
                .await;
            let Err(e) = &result else {
                return result;
            };
            // On a link without resends, redis-rs does not follow a Cluster redirect itself: the node
            // did not run the request, and the client refreshes its slot map on it. Following it is
            // not a resend, so it is not the retry policy's to refuse (redis-rs follows redirects on
            // the other links whatever the policy).
            if !self.resends && e.is_redirect() {
                if redirects.wait().await {
                    tracing::debug!(error = %e, what, "following a Cluster redirect");
                    continue;
                }
                return result;
            }
            if e.is_retryable(self.resends) && retries.wait().await {
                sent.resent |= e.is_broken_connection();
                tracing::debug!(error = %e, what, "retrying a Redis request on a fresh connection");
                continue;
            }
            return result;
        }
    }

    /// One attempt of [`run`](Self::run): the connection is replaced if the request left it in an
    /// unknown state.
    async fn attempt<T, F, Fut>(
        &self,
        target: &Target,
        what: &'static str,
        timeout: Duration,
        request: &mut F,
        sent: &mut Sent,
    ) -> Result<T, RedisError>
    where
        F: FnMut(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let (generation, conn) = self.get(target).await?;
        sent.conn = Some(conn.clone());
        let mut in_flight = InFlight {
            link: self,
            generation: Some(generation),
        };
        let outcome = tokio::time::timeout(timeout, request(conn)).await;
        in_flight.generation = None;
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
                self.invalidate(generation);
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
    generation: Option<u64>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(generation) = self.generation.take() {
            tracing::debug!(
                "a request was dropped before its reply: replacing the Redis connection"
            );
            self.link.invalidate(generation);
        }
    }
}
