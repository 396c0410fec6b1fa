//! One tokio-postgres connection: opened with the config's bound, its connection future driven by a
//! task that reports the close at once (with the server's reason, e.g. `pg_terminate_backend`) and
//! forwards `NOTIFY` payloads; plus the mapping of driver errors into [`SqlError`].

use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, CancelToken, Client, NoTls};

use crate::error::SqlError;
use crate::SqlConfig;

/// An open connection and what its driver task reports.
pub(crate) struct Conn {
    pub(crate) client: Client,
    /// `pg_backend_pid()` when it was opened.
    pub(crate) pid: i32,
    cancel: CancelToken,
    closed: watch::Receiver<Option<String>>,
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

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// The driver's config from the URL as written, with distlock's defaults where the URL says nothing.
pub(crate) fn driver_config(config: &SqlConfig) -> Result<tokio_postgres::Config, SqlError> {
    let mut driver = tokio_postgres::Config::from_str(&config.url).map_err(|e| {
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
    Ok(driver)
}

impl Conn {
    /// Opens a connection; `notify` receives the payloads of `NOTIFY`s this connection listens to.
    pub(crate) async fn open(
        driver: &tokio_postgres::Config,
        bound: Duration,
        notify: Option<broadcast::Sender<String>>,
    ) -> Result<Conn, SqlError> {
        let connecting = driver.connect(NoTls);
        let (client, mut connection) = tokio::time::timeout(bound, connecting)
            .await
            .map_err(|_| SqlError::Timeout {
                action: "connecting to PostgreSQL",
                after: bound,
            })?
            .map_err(|e| map_error("connecting to PostgreSQL", e))?;
        let (closed_tx, closed) = watch::channel(None);
        let driver = tokio::spawn(async move {
            let reason = loop {
                match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                    Some(Ok(AsyncMessage::Notification(n))) => {
                        if let Some(tx) = &notify {
                            let _ = tx.send(n.payload().to_string());
                        }
                    }
                    Some(Ok(_notice)) => {}
                    Some(Err(e)) => break format!("the connection to PostgreSQL ended: {e}"),
                    None => break "the connection to PostgreSQL was closed".to_string(),
                }
            };
            tracing::debug!(%reason, "postgres connection ended");
            let _ = closed_tx.send(Some(reason));
        })
        .abort_handle();
        let cancel = client.cancel_token();
        let row = tokio::time::timeout(bound, client.query_one("SELECT pg_backend_pid()", &[]))
            .await
            .map_err(|_| SqlError::Timeout {
                action: "reading pg_backend_pid()",
                after: bound,
            })?
            .map_err(|e| map_error("reading pg_backend_pid()", e))?;
        let pid: i32 = row
            .try_get(0)
            .map_err(|e| SqlError::Protocol(format!("pg_backend_pid() returned {e}")))?;
        Ok(Conn {
            client,
            pid,
            cancel,
            closed,
            driver,
        })
    }

    /// Whether the driver task has seen the connection end.
    pub(crate) fn closed_reason(&self) -> Option<String> {
        self.closed.borrow().clone()
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
        match tokio::time::timeout(bound, self.cancel.cancel_query(NoTls)).await {
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

/// What a driver error means, by SQLSTATE where the server sent one.
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
        if message.contains("TLS") || message.contains("tls") {
            return SqlError::Unsupported(format!(
                "{action}: {message}; distlock's PostgreSQL backend connects without TLS for now (use sslmode=disable or prefer)"
            ));
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

/// Whether a statement failed because the row or key is locked elsewhere (`FOR UPDATE NOWAIT`).
pub(crate) fn is_lock_not_available(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE)
}
