//! Connections: opening one (with distlock's timeouts), a [`Session`] (a dedicated connection with its
//! server-side id and a watch on its socket), the pool of idle sessions, the control connection that
//! sends `KILL QUERY`, and the mapping of mysql_async's errors.
//!
//! **Noticing a dropped connection at once.** mysql_async reads its socket only while a statement runs,
//! so a held session killed on the server (`KILL`, a restart) would go unnoticed until the next probe.
//! When a session connects, distlock finds the connection's socket among the process's descriptors (the
//! one socket that appeared during the connect, serialised process-wide, whose peer port is the
//! server's), keeps a duplicate of it, and waits on that for the peer's FIN (`EPOLLRDHUP`): the guard's
//! loss signal. If the socket cannot be told apart (another library connected to the same port at the
//! same moment), the session has no such signal and loss is found by the probes and the deadline.

use std::collections::HashSet;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd, RawFd};
use std::sync::Mutex as StdMutex;
use std::time::Duration;

use distlock_core::raw::LossSignal;
use mysql_async::prelude::Queryable as _;
use mysql_async::{Conn, Opts, OptsBuilder};

use crate::error::SqlError;

/// One connect at a time per process, so the socket it opens can be found (see the module docs).
static CONNECT_GATE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
/// Idle sessions kept for reuse, per backend.
const MAX_IDLE: usize = 64;

/// TCP keepalive: the first probe after this long without traffic (ms), then one every
/// [`KEEPALIVE_INTERVAL`], and the connection is dead after [`KEEPALIVE_PROBES`] unanswered ones: a
/// connection whose peer vanished without a FIN or RST (a host gone, a partition) errors within 25 s
/// of its last traffic, even while it waits for a reply to a statement the server acknowledged.
pub(crate) const KEEPALIVE_IDLE_MS: u32 = 10_000;
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_PROBES: u32 = 3;

/// How statements are bounded.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub(crate) connect: Duration,
    pub(crate) request: Duration,
}

/// Driver options from the URL as written: `mariadb://` becomes `mysql://` (the only change), and
/// `prefer_socket` is off unless the URL sets it (mysql_async would otherwise switch a loopback TCP
/// connection to the server's unix socket, bypassing whatever the URL points at). `client_found_rows` is
/// always off.
///
/// TLS is mysql_async's (`require_ssl=true`, `verify_ca=`, `verify_identity=`, `built_in_roots=`), with
/// one parameter of distlock's, as mysql_async 0.36 has no URL spelling for it: `ssl_ca=<file>` (PEM),
/// the CA trusted instead of the built-in roots; it needs `require_ssl=true`.
pub(crate) fn driver_opts(url: &str) -> Result<Opts, SqlError> {
    let url = match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_string(),
    };
    let (url, ssl_ca) = take_ssl_ca(&url)?;
    let opts = Opts::from_url(&url).map_err(|e| {
        SqlError::Config(format!(
            "the MySQL driver refused the URL: {e} (driver parameters are mysql_async's, e.g. require_ssl=true)"
        ))
    })?;
    // Affected-row counts mean "rows changed": the lease mode tells a taken row (1 inserted, 2 updated)
    // from a busy one (0 changed) by them.
    let mut builder = OptsBuilder::from_opts(opts).client_found_rows(false);
    if !url.contains("prefer_socket=") {
        builder = builder.prefer_socket(false);
    }
    // TCP keepalive on every connection (mysql_async sets only the idle time; `open` sets the probes'
    // interval and count on the socket when it finds it), unless the URL sets its own.
    if !url.contains("tcp_keepalive=") {
        builder = builder.tcp_keepalive(Some(KEEPALIVE_IDLE_MS));
    }
    if let Some(path) = ssl_ca {
        let Some(ssl) = opts_ssl(&builder) else {
            return Err(SqlError::Config(
                "URL parameter ssl_ca needs TLS: add require_ssl=true".into(),
            ));
        };
        let pem = std::fs::read(&path).map_err(|e| {
            SqlError::Config(format!("cannot read the TLS CA file {path} (ssl_ca=): {e}"))
        })?;
        if !pem
            .windows(b"-----BEGIN CERTIFICATE-----".len())
            .any(|w| w == b"-----BEGIN CERTIFICATE-----")
        {
            return Err(SqlError::Config(format!(
                "the TLS CA file {path} (ssl_ca=) holds no PEM certificate"
            )));
        }
        let ssl = ssl
            .with_root_certs(vec![pem.into()])
            .with_disable_built_in_roots(true);
        builder = builder.ssl_opts(ssl);
    }
    Ok(Opts::from(builder))
}

fn opts_ssl(builder: &OptsBuilder) -> Option<mysql_async::SslOpts> {
    Opts::from(builder.clone()).ssl_opts().cloned()
}

/// Takes `ssl_ca=` out of the URL's query (mysql_async would refuse it as unknown).
fn take_ssl_ca(url: &str) -> Result<(String, Option<String>), SqlError> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_string(), None));
    };
    let mut kept = Vec::new();
    let mut ca = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("ssl_ca", value)) => {
                let value = distlock_core::url::percent_decode(value);
                if value.is_empty() {
                    return Err(SqlError::Config(
                        "URL parameter ssl_ca is empty: name the CA certificate file (PEM)".into(),
                    ));
                }
                ca = Some(value);
            }
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((url, ca))
}

/// Whether a driver error is a failed TLS handshake (told by type: a rustls error under it).
fn is_tls_failure(e: &mysql_async::Error) -> bool {
    match e {
        mysql_async::Error::Io(mysql_async::IoError::Tls(_)) => true,
        mysql_async::Error::Io(mysql_async::IoError::Io(io)) => io
            .get_ref()
            .is_some_and(|inner| inner.is::<rustls::Error>()),
        _ => false,
    }
}

/// Maps a mysql_async error, by its typed variant and the server's error code.
pub(crate) fn map_error(action: &'static str, e: mysql_async::Error) -> SqlError {
    use mysql_async::Error as E;
    match e {
        E::Server(ref s) => match s.code {
            // ER_DBACCESS_DENIED, ER_ACCESS_DENIED, ER_TABLEACCESS_DENIED, ER_COLUMNACCESS_DENIED,
            // ER_SPECIFIC_ACCESS_DENIED
            1044 | 1045 | 1142 | 1143 | 1227 => SqlError::Denied {
                message: format!("{action}: {}", s.message),
                source: Some(Box::new(e)),
            },
            // ER_BAD_DB_ERROR, ER_NO_DB_ERROR
            1049 | 1046 => SqlError::Config(format!(
                "{action}: {} (name an existing database in the URL, mysql://host/db, or ?schema=)",
                s.message
            )),
            // ER_BAD_FIELD_ERROR, ER_NO_SUCH_TABLE after creation
            1054 => SqlError::TableShape(format!(
                "{action}: {}: the lock table exists with another shape than distlock's (name, fence, owner, expires_at); use ?table= to pick another",
                s.message
            )),
            _ => SqlError::Unavailable {
                action,
                message: format!("server error {} ({}): {}", s.code, s.state, s.message),
                source: Some(Box::new(e)),
            },
        },
        E::Url(_) => SqlError::Config(format!("{action}: {e}")),
        E::Io(_) if is_tls_failure(&e) => SqlError::Unavailable {
            action,
            message: format!(
                "the TLS handshake failed: {e} (check require_ssl, verify_ca, verify_identity and ssl_ca= in the \
                 URL: ssl_ca must name the CA that signed the server's certificate)"
            ),
            source: Some(Box::new(e)),
        },
        E::Io(_) => SqlError::Unavailable {
            action,
            message: e.to_string(),
            source: Some(Box::new(e)),
        },
        E::Driver(_) | E::Other(_) => SqlError::Protocol(format!("{action}: {e}")),
    }
}

/// Runs `f` bounded by `after`.
pub(crate) async fn bounded<T>(
    action: &'static str,
    after: Duration,
    f: impl std::future::Future<Output = Result<T, mysql_async::Error>>,
) -> Result<T, SqlError> {
    match tokio::time::timeout(after, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(map_error(action, e)),
        Err(_) => Err(SqlError::Timeout { action, after }),
    }
}

/// Runs a multi-statement query and returns the first row of the last statement that answered rows
/// (reading every answer, so the connection is ready for the next query). An error of any statement
/// is the result: mysql_async keeps the error of a statement after the first as the query's pending
/// result (`is_empty` is then true), which only reading on (`drop_result`) returns.
pub(crate) async fn last_row(
    conn: &mut Conn,
    sql: String,
) -> Result<Option<mysql_async::Row>, mysql_async::Error> {
    let mut result = conn.query_iter(sql).await?;
    let mut last = None;
    while !result.is_empty() {
        let rows: Vec<mysql_async::Row> = result.collect().await?;
        if let Some(row) = rows.into_iter().next() {
            last = Some(row);
        }
    }
    result.drop_result().await?;
    Ok(last)
}

/// Opens a connection (bounded by the connect timeout); returns it with the watch descriptor of its
/// socket, if found.
pub(crate) async fn open(
    opts: &Opts,
    limits: &Limits,
) -> Result<(Conn, Option<OwnedFd>), SqlError> {
    let gate = CONNECT_GATE.lock().await;
    let before = socket_inodes();
    let conn = bounded(
        "connecting to MySQL/MariaDB",
        limits.connect,
        Conn::new(opts.clone()),
    )
    .await?;
    let watch = find_socket(&before, opts);
    drop(gate);
    if let Some(fd) = &watch {
        tune_keepalive(fd);
    }
    let mut conn = conn;
    bounded(
        "setting the session's settings",
        limits.request,
        conn.query_drop(super::layout::session_setup()),
    )
    .await?;
    Ok((conn, watch))
}

/// Sets the keepalive probes' interval and count on a TCP connection's socket (a duplicate of it:
/// the options belong to the socket). A unix socket, or a failure, keeps the system's values.
fn tune_keepalive(fd: &OwnedFd) {
    use rustix::net::sockopt;
    let is_tcp = matches!(sockopt::socket_domain(fd), Ok(d) if d == rustix::net::AddressFamily::INET || d == rustix::net::AddressFamily::INET6);
    if !is_tcp || !sockopt::socket_keepalive(fd).unwrap_or(false) {
        return;
    }
    let set = sockopt::set_tcp_keepintvl(fd, KEEPALIVE_INTERVAL)
        .and_then(|()| sockopt::set_tcp_keepcnt(fd, KEEPALIVE_PROBES));
    if let Err(e) = set {
        tracing::debug!(error = %e, "could not set the keepalive interval; the system's applies");
    }
}

/// A dedicated connection: a held lock's, or a waiter's.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) conn: Conn,
    /// `CONNECTION_ID()` when it connected.
    pub(crate) id: u64,
    /// The `wait_timeout` this session was last set to, seconds.
    pub(crate) wait_timeout: Option<u64>,
    /// A duplicate of the connection's socket, to notice the server closing it.
    watch: Option<OwnedFd>,
    /// Dropped with the session: tells its loss signals to let go of their duplicate of the socket, so
    /// that a dropped session's socket closes (and the server frees its locks) even while a signal lives.
    alive: tokio::sync::watch::Sender<()>,
    /// When it was last put back in the idle list.
    idle_since: std::time::Instant,
}

impl Session {
    /// Opens a session and reads its server-side id.
    pub(crate) async fn open(opts: &Opts, limits: &Limits) -> Result<Session, SqlError> {
        let (mut conn, watch) = open(opts, limits).await?;
        let id: Option<u64> = bounded(
            "reading CONNECTION_ID()",
            limits.request,
            conn.query_first("SELECT CONNECTION_ID()"),
        )
        .await?;
        let id = id.ok_or_else(|| SqlError::Protocol("CONNECTION_ID() returned no row".into()))?;
        Ok(Session {
            conn,
            id,
            wait_timeout: Some(super::layout::IDLE_WAIT_TIMEOUT_SECS),
            watch,
            alive: tokio::sync::watch::channel(()).0,
            idle_since: std::time::Instant::now(),
        })
    }

    /// Whether the server has closed the socket (only known where the socket was found).
    pub(crate) fn server_closed(&self) -> bool {
        self.watch
            .as_ref()
            .is_some_and(|fd| peer_closed(fd.as_raw_fd()))
    }

    /// Whether the session has been idle for half its `wait_timeout` or more: the server may end it
    /// while the next statement is on its way, so it is not reused.
    fn near_wait_timeout(&self) -> bool {
        self.wait_timeout
            .is_some_and(|secs| self.idle_since.elapsed() >= Duration::from_secs(secs) / 2)
    }

    /// A future that resolves when the server closes this session's socket; `None` if the socket was
    /// not found.
    pub(crate) fn loss_signal(&self) -> Option<LossSignal> {
        let fd = self.watch.as_ref()?.try_clone().ok()?;
        let id = self.id;
        let mut alive = self.alive.subscribe();
        Some(LossSignal::from_future(async move {
            tokio::select! {
                () = wait_peer_closed(fd) => {}
                // The session was dropped (released, or closed on purpose): no loss to report, and the
                // duplicate is closed here so it does not keep the socket open.
                _ = alive.changed() => return std::future::pending().await,
            }
            format!(
                "the server closed the lock's connection (session {id} killed, timed out or the server restarted)"
            )
        }))
    }
}

/// Idle sessions for reuse.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    idle: StdMutex<Vec<Session>>,
}

impl Pool {
    /// An idle session that the server has not closed, or a new one.
    pub(crate) async fn checkout(&self, opts: &Opts, limits: &Limits) -> Result<Session, SqlError> {
        loop {
            let next = self.idle.lock().ok().and_then(|mut idle| idle.pop());
            match next {
                Some(s) if s.server_closed() || s.near_wait_timeout() => continue,
                Some(s) => return Ok(s),
                None => return Session::open(opts, limits).await,
            }
        }
    }

    /// Keeps a clean session (no lock, no statement in flight) for reuse.
    pub(crate) fn checkin(&self, mut session: Session) {
        session.idle_since = std::time::Instant::now();
        // The hold it served (if any) is over: its loss signals stand down.
        session.alive.send_replace(());
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < MAX_IDLE {
                idle.push(session);
            }
        }
    }
}

/// Sends `KILL QUERY <id>` on the backend's control connection (opened on first use, reopened once if
/// it broke).
pub(crate) async fn kill_query(
    control: &tokio::sync::Mutex<Option<Conn>>,
    opts: &Opts,
    limits: &Limits,
    id: u64,
) -> Result<(), SqlError> {
    let mut slot = control.lock().await;
    for attempt in 0..2 {
        let mut conn = match slot.take() {
            Some(c) => c,
            None => open(opts, limits).await?.0,
        };
        let sent =
            tokio::time::timeout(limits.request, conn.query_drop(format!("KILL QUERY {id}"))).await;
        match sent {
            Ok(Ok(())) => {
                *slot = Some(conn);
                return Ok(());
            }
            // ER_NO_SUCH_THREAD: the session is gone already, so is its wait.
            Ok(Err(mysql_async::Error::Server(e))) if e.code == 1094 => {
                *slot = Some(conn);
                return Ok(());
            }
            Ok(Err(e)) if attempt == 1 => return Err(map_error("sending KILL QUERY", e)),
            Err(_) if attempt == 1 => {
                return Err(SqlError::Timeout {
                    action: "sending KILL QUERY",
                    after: limits.request,
                })
            }
            _ => {}
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Finding and watching a connection's socket.

fn socket_inodes() -> HashSet<(RawFd, String)> {
    let mut out = HashSet::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return out;
    };
    for entry in dir.flatten() {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<RawFd>() else {
            continue;
        };
        if let Ok(target) = std::fs::read_link(entry.path()) {
            let target = target.to_string_lossy().into_owned();
            if target.starts_with("socket:[") {
                out.insert((fd, target));
            }
        }
    }
    out
}

/// The one socket that appeared since `before` and talks to the server's port; duplicated.
fn find_socket(before: &HashSet<(RawFd, String)>, opts: &Opts) -> Option<OwnedFd> {
    let port = opts.tcp_port();
    let unix = opts.socket().is_some();
    let mut found = Vec::new();
    for (fd, inode) in socket_inodes().difference(before) {
        let borrowed = borrow_raw_fd(*fd)?;
        let Ok(peer) = rustix::net::getpeername(borrowed) else {
            continue;
        };
        let Some(peer) = peer else {
            continue;
        };
        let matches = match std::net::SocketAddr::try_from(peer) {
            Ok(ip) => !unix && ip.port() == port,
            Err(_) => unix,
        };
        if matches {
            found.push((*fd, inode.clone()));
        }
    }
    let [(fd, inode)] = found.as_slice() else {
        tracing::debug!(
            candidates = found.len(),
            "could not single out the connection's socket; loss is found by probes"
        );
        return None;
    };
    let dup = rustix::io::fcntl_dupfd_cloexec(borrow_raw_fd(*fd)?, 0).ok()?;
    // The descriptor number may have been reused in between: check it is still that socket.
    let same = std::fs::read_link(format!("/proc/self/fd/{}", dup.as_raw_fd()))
        .map(|t| t.to_string_lossy() == inode.as_str())
        .unwrap_or(false);
    same.then_some(dup)
}

/// A borrowed descriptor for a number read from `/proc/self/fd`. The number may be closed (and reused)
/// by another thread at any moment; the syscalls made with it are read-only or duplicate it, and the
/// duplicate's identity is checked afterwards, so a stale number costs a wrong guess, never memory.
fn borrow_raw_fd(fd: RawFd) -> Option<std::os::fd::BorrowedFd<'static>> {
    if fd < 0 {
        return None;
    }
    // SAFETY: see above; the BorrowedFd is used only for getpeername/fcntl, which fail cleanly on a
    // closed descriptor.
    Some(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
}

/// Whether the peer has closed the connection (`POLLRDHUP`/`POLLHUP`), without reading.
fn peer_closed(fd: RawFd) -> bool {
    let Some(borrowed) = borrow_raw_fd(fd) else {
        return false;
    };
    let mut fds = [rustix::event::PollFd::new(
        &borrowed,
        rustix::event::PollFlags::RDHUP,
    )];
    match rustix::event::poll(&mut fds, Some(&rustix::event::Timespec::default())) {
        Ok(n) if n > 0 => fds[0].revents().intersects(
            rustix::event::PollFlags::RDHUP
                | rustix::event::PollFlags::HUP
                | rustix::event::PollFlags::ERR,
        ),
        _ => false,
    }
}

/// Resolves when the peer closes; stays pending if the runtime cannot watch the descriptor (never a
/// false loss). Registers on whatever runtime polls it, and again if that runtime goes away.
async fn wait_peer_closed(fd: OwnedFd) {
    let raw = fd.as_fd().as_raw_fd();
    loop {
        if peer_closed(raw) {
            return;
        }
        let Ok(dup) = fd.try_clone() else {
            return std::future::pending().await;
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return std::future::pending().await;
        }
        // SAFETY: `dup` is an OwnedFd moved into the AsyncFd: it stays open and refers to the same open
        // file description for the AsyncFd's whole life, and `as_raw_fd` always returns it.
        let registered = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(dup, tokio::io::Interest::READABLE)
        };
        let Ok(watched) = registered else {
            return std::future::pending().await;
        };
        // An error means the runtime that registered it is gone: register again on the current one.
        while let Ok(mut guard) = watched.readable().await {
            if guard.ready().is_read_closed() || peer_closed(raw) {
                return;
            }
            guard.clear_ready();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
