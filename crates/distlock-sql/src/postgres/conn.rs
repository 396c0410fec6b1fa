//! One tokio-postgres connection: opened with the config's bound, its connection future driven by a
//! task that reports the close at once (with the server's reason, e.g. `pg_terminate_backend`) and
//! forwards `NOTIFY` payloads; plus the mapping of driver errors into [`SqlError`].

use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distlock_core::raw::{LossReport, LossSignal};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{AsyncMessage, CancelToken, Client, Row, SimpleQueryMessage, Statement};

use super::layout;
use super::tls::{self, MakeRustls};
use crate::config::AdvisoryKey;
use crate::error::SqlError;
use crate::SqlConfig;

/// An open connection and what its driver task reports.
pub(crate) struct Conn {
    pub(crate) client: Client,
    /// `pg_backend_pid()` when it was opened.
    pub(crate) pid: i32,
    /// The process id of the cancel key the login handed out (BackendKeyData): the backend's pid when
    /// distlock talks to PostgreSQL itself, a pooler's own key otherwise (see [`Conn::refuse_pooler`]).
    key_pid: Option<i32>,
    cancel: CancelToken,
    /// The connection's TLS, for the cancel request.
    tls: MakeRustls,
    closed: watch::Receiver<Option<String>>,
    /// The server ended the session itself (it sent an error, e.g. FATAL on `idle_session_timeout` or
    /// `pg_terminate_backend`, before closing); set before `closed`.
    ended_by_server: Arc<AtomicBool>,
    /// The loss report of the hold this connection carries, reported by the driver task when it ends
    /// (closed, reset, or aborted because distlock dropped the connection): no task per hold.
    hold_loss: HoldLoss,
    /// The idle bound the session runs with, as distlock last set it, and since when the connection
    /// has waited in the idle pool ([`IdleBound`]).
    idle_bound: std::sync::Mutex<IdleBound>,
    /// The session `LISTEN`s on the wake-up channel (the control connection, while waiters want it).
    listening: AtomicBool,
    /// The hot statements prepared on this connection, by their text ([`Conn::query_one_cached`]).
    statements: std::sync::Mutex<std::collections::HashMap<String, Statement>>,
    /// The task driving the connection future: aborted on drop, so the socket closes at once even
    /// with a statement still waiting in the server (dropping only the client would keep the socket
    /// open until that statement answers).
    driver: tokio::task::AbortHandle,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// The session's idle bound (`idle_session_timeout`, in ms) as the last confirmed statement set it;
/// `None` while a statement that may change it is in flight or failed. A held session keeps its
/// bound after its release, so the next try with the same lease on this connection need not send the
/// probe again: the try is itself the statement that restarts the server's idle clock. A connection
/// idle in the pool for half its bound is treated as unknown (the server may end it at the bound), and
/// the pool resets such a connection's bound before the server would (`Inner::recycle`).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdleBound {
    pub(crate) ms: Option<u64>,
    /// When the connection was handed to the idle pool; `None` while in use.
    pub(crate) parked_at: Option<Instant>,
}

impl IdleBound {
    /// When a connection parked with this bound must leave the pool's trust: half the bound after it
    /// was parked, less a quarter of that half (at most 200 ms) for the reply that preceded the parking
    /// and the reset's own round trip (`None`: no bound runs, nothing ends it).
    pub(crate) fn stale_at(&self) -> Option<Instant> {
        let ms = self.ms.filter(|ms| *ms > 0)?;
        let half = Duration::from_millis(ms / 2);
        Some(self.parked_at? + half - (half / 4).min(Duration::from_millis(200)))
    }
}

/// Where a connection's driver task finds the loss report of the hold the connection carries.
type HoldLoss = Arc<std::sync::Mutex<Option<LossReport>>>;

fn lock_hold_loss(slot: &HoldLoss) -> std::sync::MutexGuard<'_, Option<LossReport>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Reports the connection's end into the hold it carries when the driver task ends, also when it is
/// aborted (dropped with the connection): the reason found, or "closed".
struct ReportOnEnd {
    slot: HoldLoss,
    reason: Option<String>,
}

impl Drop for ReportOnEnd {
    fn drop(&mut self) {
        // Taken out first: the report runs with the slot unlocked.
        let report = lock_hold_loss(&self.slot).take();
        if let Some(report) = report {
            report.report(
                self.reason
                    .take()
                    .unwrap_or_else(|| "the connection to PostgreSQL was closed".to_string()),
            );
        }
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// Owned parameters of one statement, with their types, for [`Conn::query_one_cached`].
#[derive(Default)]
pub(crate) struct Params {
    values: Vec<(Box<dyn ToSql + Sync + Send>, Type)>,
}

impl Params {
    /// A `text` parameter.
    pub(crate) fn text(mut self, value: impl Into<String>) -> Self {
        self.values.push((Box::new(value.into()), Type::TEXT));
        self
    }

    /// An `integer` parameter.
    pub(crate) fn int4(mut self, value: i32) -> Self {
        self.values.push((Box::new(value), Type::INT4));
        self
    }

    /// An advisory key's parameters, as `layout`'s statements read them: one `bigint`, or two
    /// `integer`s.
    pub(crate) fn key(mut self, key: AdvisoryKey) -> Self {
        match key {
            AdvisoryKey::Single(k) => self.values.push((Box::new(k), Type::INT8)),
            AdvisoryKey::Pair(a, b) => {
                self.values.push((Box::new(a), Type::INT4));
                self.values.push((Box::new(b), Type::INT4));
            }
        }
        self
    }

    /// As the driver takes them.
    pub(crate) fn refs(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        self.values
            .iter()
            .map(|(value, ty)| (value.as_ref() as &(dyn ToSql + Sync), ty.clone()))
            .collect()
    }
}

/// The most statements [`Conn::query_one_cached`] keeps prepared on one connection.
pub(crate) const MAX_PREPARED: usize = 64;

/// Idle time before the first TCP keepalive probe (see [`driver_config`]).
pub(crate) const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// Time between unanswered keepalive probes.
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the kernel ends the connection.
pub(crate) const KEEPALIVE_RETRIES: u32 = 3;

/// How to connect: the driver's config and the TLS hook (see [`tls`]).
#[derive(Debug, Clone)]
pub(crate) struct Driver {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) tls: MakeRustls,
}

/// The driver's config from the URL as written (libpq's `sslmode=verify-*` and `sslrootcert=` taken
/// out first, as tokio-postgres knows neither), with distlock's defaults where the URL says nothing.
pub(crate) fn driver_config(config: &SqlConfig) -> Result<Driver, SqlError> {
    let request = tls::read_url(&config.url)?;
    let tls = MakeRustls::new(tls::client_config(&request)?);
    let mut driver = tokio_postgres::Config::from_str(&request.url).map_err(|e| {
        SqlError::Config(format!(
            "the PostgreSQL URL is not one tokio-postgres accepts: {e}"
        ))
    })?;
    if driver.get_application_name().is_none() {
        driver.application_name("distlock");
    }
    if driver.get_connect_timeout().is_none() {
        driver.connect_timeout(config.connection.connect_timeout);
    }
    // TCP keepalive on every connection, probing well before the driver's default of two hours, so a
    // peer that vanished without FIN or RST (a dropped NAT entry, a dead host) ends the connection
    // within KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_RETRIES (25 s). The driver turns
    // keepalive on by default; the URL's own `keepalives=0` / `keepalives_*=` win.
    let url_sets = |key: &str| request.url.contains(&format!("{key}="));
    if !url_sets("keepalives_idle") {
        driver.keepalives_idle(KEEPALIVE_IDLE);
    }
    if !url_sets("keepalives_interval") {
        driver.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if !url_sets("keepalives_retries") {
        driver.keepalives_retries(KEEPALIVE_RETRIES);
    }
    Ok(Driver {
        config: driver,
        tls,
    })
}

impl Conn {
    /// Opens a connection; `notify` receives the payloads of `NOTIFY`s this connection listens to.
    pub(crate) async fn open(
        driver: &Driver,
        bound: Duration,
        notify: Option<broadcast::Sender<String>>,
    ) -> Result<Conn, SqlError> {
        let tls = driver.tls.clone();
        let connecting = driver.config.connect(tls.clone());
        let (client, mut connection) = tokio::time::timeout(bound, connecting)
            .await
            .map_err(|_| SqlError::Timeout {
                action: "connecting to PostgreSQL",
                after: bound,
            })?
            .map_err(|e| map_error("connecting to PostgreSQL", e))?;
        let (closed_tx, closed) = watch::channel(None);
        let ended_by_server = Arc::new(AtomicBool::new(false));
        let server_ended = ended_by_server.clone();
        let hold_loss = HoldLoss::default();
        let mut on_end = ReportOnEnd {
            slot: hold_loss.clone(),
            reason: None,
        };
        let driver = tokio::spawn(async move {
            let reason = loop {
                match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                    Some(Ok(AsyncMessage::Notification(n))) => {
                        if let Some(tx) = &notify {
                            let _ = tx.send(n.payload().to_string());
                        }
                    }
                    Some(Ok(_notice)) => {}
                    Some(Err(e)) => {
                        if e.as_db_error().is_some() {
                            server_ended.store(true, Ordering::Release);
                        }
                        break format!("the connection to PostgreSQL ended: {e}");
                    }
                    None => break "the connection to PostgreSQL was closed".to_string(),
                }
            };
            tracing::debug!(%reason, "postgres connection ended");
            // `closed` first: a hold given the connection after this sees it closed (`loss_signal`).
            let _ = closed_tx.send(Some(reason.clone()));
            on_end.reason = Some(reason);
            drop(on_end);
        })
        .abort_handle();
        let cancel = client.cancel_token();
        let key_pid = key_pid(&cancel).await;
        // The settings distlock's statements rely on, set by the session itself (whatever the server,
        // database or role defaults say), in the same round trip as the pid.
        let setup = format!("{}; SELECT pg_backend_pid()", layout::SESSION_SETTINGS);
        let messages = tokio::time::timeout(bound, client.simple_query(&setup))
            .await
            .map_err(|_| SqlError::Timeout {
                action: "setting up the session",
                after: bound,
            })?
            .map_err(|e| map_error("setting up the session", e))?;
        let pid = messages
            .iter()
            .filter_map(|m| match m {
                SimpleQueryMessage::Row(row) => row.get(0).and_then(|p| p.parse::<i32>().ok()),
                _ => None,
            })
            .last()
            .ok_or_else(|| {
                SqlError::Protocol("the session setup returned no pg_backend_pid()".into())
            })?;
        Ok(Conn {
            client,
            pid,
            key_pid,
            cancel,
            tls,
            closed,
            ended_by_server,
            hold_loss,
            // The setup above set it off.
            idle_bound: std::sync::Mutex::new(IdleBound {
                ms: Some(0),
                parked_at: None,
            }),
            listening: AtomicBool::new(false),
            statements: std::sync::Mutex::default(),
            driver,
        })
    }

    /// Refuses a connection whose server session is not its own: a pooler (PgBouncer) hands clients a
    /// cancel key of its own at login, so the key's process id is not `pg_backend_pid()`. A
    /// transaction pooler moves the client between server sessions from one transaction to the next,
    /// so a session advisory lock would stay behind on a server connection other clients then get.
    /// Checked at login, before any lock: the pid comparison of each probe only notices the move once
    /// the pooler happens to make it.
    pub(crate) fn refuse_pooler(&self) -> Result<(), SqlError> {
        match self.key_pid {
            Some(key) if key != self.pid => Err(SqlError::SessionChanged(format!(
                "the login's cancel key names process {key} but pg_backend_pid() is {}: a connection pooler \
                 (PgBouncer) sits between distlock and PostgreSQL, and advisory and row locks live in a server \
                 session, which a transaction pooler does not keep for one client; connect to PostgreSQL \
                 directly or use ?mode=lease",
                self.pid
            ))),
            _ => Ok(()),
        }
    }

    /// Whether the driver task has seen the connection end.
    pub(crate) fn closed_reason(&self) -> Option<String> {
        self.closed.borrow().clone()
    }

    /// Whether the server ended the session itself (it sent an error before closing): meaningful once
    /// [`closed_reason`](Self::closed_reason) is `Some`.
    pub(crate) fn ended_by_server(&self) -> bool {
        self.ended_by_server.load(Ordering::Acquire)
    }

    /// The loss signal of a hold this connection now carries: fires when the connection ends, from
    /// its driver task (no task of its own). Replaces the previous hold's.
    pub(crate) fn loss_signal(&self) -> LossSignal {
        let report = LossReport::new();
        *lock_hold_loss(&self.hold_loss) = Some(report.clone());
        // Ended before the report was in place: the driver task found none to report into.
        if let Some(reason) = self.closed_reason() {
            report.report(reason);
        }
        report.signal()
    }

    /// Whether the session `LISTEN`s on the wake-up channel (as last confirmed).
    pub(crate) fn listening(&self) -> bool {
        self.listening.load(Ordering::Acquire)
    }

    pub(crate) fn set_listening(&self, on: bool) {
        self.listening.store(on, Ordering::Release);
    }

    /// The session's idle bound as distlock knows it.
    pub(crate) fn idle_bound(&self) -> IdleBound {
        *self.lock_idle_bound()
    }

    /// Records the idle bound a confirmed statement set (`None`: unknown, before a statement that may
    /// change it, or after one that failed).
    pub(crate) fn set_idle_bound(&self, ms: Option<u64>) {
        self.lock_idle_bound().ms = ms;
    }

    /// Handed to the idle pool now.
    pub(crate) fn park(&self) {
        self.lock_idle_bound().parked_at = Some(Instant::now());
    }

    /// Taken out of the idle pool: a bound that may run out soon (parked for half of it) is no longer
    /// trusted, so the next try sends the probe. Returns whether the connection had been parked.
    pub(crate) fn unpark(&self) -> bool {
        let mut bound = self.lock_idle_bound();
        if bound.stale_at().is_some_and(|at| at <= Instant::now()) {
            bound.ms = None;
        }
        bound.parked_at.take().is_some()
    }

    fn lock_idle_bound(&self) -> std::sync::MutexGuard<'_, IdleBound> {
        self.idle_bound
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The connection no longer carries a hold (released, or handed back to the pool).
    pub(crate) fn clear_loss(&self) {
        lock_hold_loss(&self.hold_loss).take();
    }

    /// Runs `sql` (one row expected) as a statement prepared on this connection: a statement the
    /// server has parsed and planned once costs it a bind and an execute, not a parse and a plan each
    /// time (distlock's permit and lock statements plan in more time than they run). The first use
    /// sends the prepare pipelined behind the statement itself, so it costs no round trip of its own;
    /// later uses run the prepared one. The texts are per statement shape (keys and names are
    /// parameters), a handful per connection; [`MAX_PREPARED`] bounds them all the same.
    pub(crate) async fn query_one_cached(
        &self,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Row, tokio_postgres::Error> {
        let prepared = self.lock_statements().get(sql).cloned();
        if let Some(statement) = prepared {
            let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
            return self.client.query_one(&statement, &values).await;
        }
        let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
        let (row, prepared) = futures_util::future::join(
            self.client.query_typed_one(sql, params),
            self.client.prepare_typed(sql, &types),
        )
        .await;
        if let Ok(statement) = prepared {
            let mut statements = self.lock_statements();
            if statements.len() >= MAX_PREPARED {
                statements.clear();
            }
            statements.insert(sql.to_string(), statement);
        }
        row
    }

    fn lock_statements(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Statement>> {
        self.statements
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Resolves with the reason once the connection ends.
    pub(crate) fn closed(&self) -> impl Future<Output = String> + Send + 'static {
        let mut closed = self.closed.clone();
        async move {
            match closed.wait_for(Option::is_some).await {
                Ok(reason) => reason.clone().unwrap_or_default(),
                Err(_) => "the connection to PostgreSQL was closed".to_string(),
            }
        }
    }

    /// Asks the server to cancel whatever this connection is running (a wait), on a connection of its
    /// own, bounded by `bound`. Best effort: the caller closes this connection afterwards anyway.
    pub(crate) async fn cancel(&self, bound: Duration) {
        match tokio::time::timeout(bound, self.cancel.cancel_query(self.tls.clone())).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "cancel request failed"),
            Err(_) => tracing::debug!("cancel request timed out"),
        }
    }

    /// Runs `fut` (a statement on this connection) within `bound`.
    pub(crate) async fn bounded<T>(
        action: &'static str,
        bound: Duration,
        fut: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, SqlError> {
        tokio::time::timeout(bound, fut)
            .await
            .map_err(|_| SqlError::Timeout {
                action,
                after: bound,
            })?
            .map_err(|e| map_error(action, e))
    }
}

/// The process id in a connection's cancel key. tokio-postgres keeps the key private but writes it
/// out as a cancel request on any stream: here an in-memory one, answered as a server would (`S` to
/// the TLS request, then the handshake is a no-op), so nothing reaches the network. `None` if the
/// request could not be read back.
async fn key_pid(cancel: &CancelToken) -> Option<i32> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (client, mut server) = tokio::io::duplex(64);
    let reader = async move {
        let mut head = [0u8; 8];
        server.read_exact(&mut head).await.ok()?;
        // SSLRequest: length 8, code 80877103.
        if head[4..8] == 80_877_103_i32.to_be_bytes() {
            server.write_all(b"S").await.ok()?;
            server.read_exact(&mut head).await.ok()?;
        }
        // CancelRequest: length 16, code 80877102, process id, secret key.
        if head[4..8] != 80_877_102_i32.to_be_bytes() {
            return None;
        }
        let mut pid = [0u8; 4];
        server.read_exact(&mut pid).await.ok()?;
        Some(i32::from_be_bytes(pid))
    };
    let (_, pid) = tokio::join!(cancel.cancel_query_raw(client, tls::Plain), reader);
    pid
}

/// What a driver error means, by SQLSTATE where the server sent one.
/// Whether a statement failed because its connection had closed (a reset link, a server-ended
/// session): the driver's own "connection closed", found in the error's source.
pub(crate) fn connection_closed(error: &SqlError) -> bool {
    matches!(
        error,
        SqlError::Unavailable { source: Some(source), .. }
            if source
                .downcast_ref::<tokio_postgres::Error>()
                .is_some_and(tokio_postgres::Error::is_closed)
    )
}

pub(crate) fn map_error(action: &'static str, e: tokio_postgres::Error) -> SqlError {
    let message = e.as_db_error().map_or_else(
        || {
            let mut text = e.to_string();
            if let Some(source) = std::error::Error::source(&e) {
                text = format!("{text}: {source}");
            }
            text
        },
        |db| db.message().to_string(),
    );
    let Some(code) = e.code() else {
        if tls::is_tls_failure(&e) {
            // Told by the error's type (a rustls error under the driver's), not by its words.
            return SqlError::Unavailable {
                action,
                message: format!(
                    "the TLS handshake failed: {message} (check sslmode and sslrootcert= in the URL: \
                     sslrootcert must name the CA that signed the server's certificate)"
                ),
                source: Some(Box::new(e)),
            };
        }
        return SqlError::Unavailable {
            action,
            message,
            source: Some(Box::new(e)),
        };
    };
    let denied = |hint: &str| SqlError::Denied {
        message: format!("{action}: {message}{hint}"),
        source: None,
    };
    match code {
        c if *c == SqlState::INVALID_PASSWORD
            || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION =>
        {
            denied(" (check the user and password in the URL)")
        }
        c if *c == SqlState::INSUFFICIENT_PRIVILEGE => denied(
            " (the role needs CREATE on the schema for the first use, then SELECT, INSERT and UPDATE on distlock's tables)",
        ),
        c if *c == SqlState::INVALID_CATALOG_NAME => {
            SqlError::Config(format!("{action}: {message} (check the database in the URL)"))
        }
        c if *c == SqlState::UNDEFINED_TABLE
            || *c == SqlState::UNDEFINED_COLUMN
            || *c == SqlState::DATATYPE_MISMATCH
            || *c == SqlState::INVALID_SCHEMA_NAME =>
        {
            SqlError::TableShape(format!(
                "{action}: {message}; the table does not have distlock's shape (see distlock_sql::postgres::layout) \
                 or the schema does not exist: pick another ?table= or ?schema="
            ))
        }
        _ => SqlError::Unavailable {
            action,
            message: format!("{message} (SQLSTATE {})", code.code()),
            source: Some(Box::new(e)),
        },
    }
}

/// Whether a statement's error is the server ending the session (a FATAL error: `idle_session_timeout`,
/// `pg_terminate_backend`, a shutdown), as opposed to the link breaking.
pub(crate) fn is_fatal(e: &SqlError) -> bool {
    matches!(
        e,
        SqlError::Unavailable { source: Some(source), .. }
            if source
                .downcast_ref::<tokio_postgres::Error>()
                .and_then(tokio_postgres::Error::as_db_error)
                .is_some_and(|db| db.severity() == "FATAL" || db.severity() == "PANIC")
    )
}

/// Whether a statement failed because the row or key is locked elsewhere (`FOR UPDATE NOWAIT`).
pub(crate) fn is_lock_not_available(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE)
}
