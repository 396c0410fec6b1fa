//! A standalone `redis-server` on a reserved loopback port, plus a tiny blocking RESP2 client.
//!
//! The client is hand-written on purpose: the testkit must not depend on the Redis client the backend
//! under test uses, or a bug there could hide itself (and readiness needs only PING and INFO).

use std::fmt;
use std::io::{self, BufRead, BufReader, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::ports::{self, PortLease};
use crate::process::{self, Probe, ReadyProbe, ServerProcess, ServerSpec};

/// The server binary.
pub const REDIS_SERVER: &str = "redis-server";
/// Shown when it is missing.
pub const INSTALL_HINT: &str =
    "install it with `apt-get install -y redis-server` (or run scripts/setup.sh)";
/// Timeout of [`RedisServer::command`].
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// Per-probe I/O timeout during readiness, short so the 30 s deadline is checked often.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespValue {
    /// `+OK`
    Simple(String),
    /// `-ERR ...` (a reply, not a transport failure, so it is a value here).
    Error(String),
    /// `:42`
    Int(i64),
    /// `$3\r\nfoo`
    Bulk(Vec<u8>),
    /// `$-1` or `*-1`
    Nil,
    /// `*2 ...`
    Array(Vec<RespValue>),
}

impl RespValue {
    /// The text of a simple string or a UTF-8 bulk string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            RespValue::Simple(s) => Some(s),
            RespValue::Bulk(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// The value of an integer reply.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            RespValue::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// Whether this is a nil reply.
    pub fn is_nil(&self) -> bool {
        matches!(self, RespValue::Nil)
    }

    /// Whether this is an error reply.
    pub fn is_error(&self) -> bool {
        matches!(self, RespValue::Error(_))
    }
}

impl fmt::Display for RespValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RespValue::Simple(s) => write!(f, "{s}"),
            RespValue::Error(e) => write!(f, "(error) {e}"),
            RespValue::Int(i) => write!(f, "(integer) {i}"),
            RespValue::Bulk(b) => write!(f, "{:?}", String::from_utf8_lossy(b)),
            RespValue::Nil => write!(f, "(nil)"),
            RespValue::Array(items) => {
                write!(f, "[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{item}")?;
                }
                write!(f, "]")
            }
        }
    }
}

/// Encodes a command as a RESP array of bulk strings.
pub fn encode<A: AsRef<[u8]>>(args: &[A]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        let arg = arg.as_ref();
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Nesting limit for arrays, so a hostile or broken peer cannot overflow the stack.
const MAX_DEPTH: usize = 32;
/// Largest bulk string accepted (Redis's own `proto-max-bulk-len` default).
const MAX_BULK: usize = 512 * 1024 * 1024;

/// Reads one RESP2 value.
pub fn read_value(r: &mut impl BufRead) -> io::Result<RespValue> {
    read_at(r, 0)
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn read_line(r: &mut impl BufRead) -> io::Result<String> {
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed by the server",
        ));
    }
    if !line.ends_with(b"\r\n") {
        return Err(bad("RESP line without CRLF"));
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).map_err(|_| bad("RESP line is not UTF-8"))
}

fn read_at(r: &mut impl BufRead, depth: usize) -> io::Result<RespValue> {
    if depth > MAX_DEPTH {
        return Err(bad("RESP nesting too deep"));
    }
    let line = read_line(r)?;
    let (kind, rest) = line
        .split_at_checked(1)
        .ok_or_else(|| bad("empty RESP line"))?;
    let int = |s: &str| -> io::Result<i64> {
        s.parse()
            .map_err(|_| bad(format!("bad RESP integer {s:?}")))
    };
    match kind {
        "+" => Ok(RespValue::Simple(rest.to_owned())),
        "-" => Ok(RespValue::Error(rest.to_owned())),
        ":" => Ok(RespValue::Int(int(rest)?)),
        "$" => {
            let len = int(rest)?;
            if len < 0 {
                return Ok(RespValue::Nil);
            }
            let len = usize::try_from(len)
                .ok()
                .filter(|l| *l <= MAX_BULK)
                .ok_or_else(|| bad("RESP bulk too large"))?;
            let mut buf = vec![0; len + 2];
            r.read_exact(&mut buf)?;
            if !buf.ends_with(b"\r\n") {
                return Err(bad("RESP bulk without CRLF"));
            }
            buf.truncate(len);
            Ok(RespValue::Bulk(buf))
        }
        "*" => {
            let n = int(rest)?;
            if n < 0 {
                return Ok(RespValue::Nil);
            }
            let n = usize::try_from(n).map_err(|_| bad("RESP array too large"))?;
            let mut items = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                items.push(read_at(r, depth + 1)?);
            }
            Ok(RespValue::Array(items))
        }
        other => Err(bad(format!("unknown RESP type {other:?}"))),
    }
}

/// A blocking RESP2 connection for tests (one request at a time).
#[derive(Debug)]
pub struct RespConn {
    addr: SocketAddr,
    reader: BufReader<TcpStream>,
    timeout: Duration,
}

impl RespConn {
    /// Connects with `timeout` for the connect and for every later read and write.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<RespConn> {
        let stream = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| io_error(format!("connecting to {addr}"), timeout, e))?;
        let _ = stream.set_nodelay(true);
        let mut conn = RespConn {
            addr,
            reader: BufReader::new(stream),
            timeout,
        };
        conn.set_timeout(timeout)?;
        Ok(conn)
    }

    /// Changes the read/write timeout.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        let stream = self.reader.get_ref();
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| Error::io("setting socket timeouts", e))?;
        self.timeout = timeout;
        Ok(())
    }

    /// Sends one command and reads its reply. An error *reply* is `Ok(RespValue::Error)`; `Err` means the
    /// transport failed ([`Error::Timeout`] if the server did not answer in time).
    pub fn command<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Result<RespValue> {
        let what = || {
            let name = args
                .first()
                .map(|a| String::from_utf8_lossy(a.as_ref()).into_owned())
                .unwrap_or_default();
            format!("`{name}` to {}", self.addr)
        };
        self.reader
            .get_mut()
            .write_all(&encode(args))
            .map_err(|e| io_error(what(), self.timeout, e))?;
        read_value(&mut self.reader).map_err(|e| io_error(what(), self.timeout, e))
    }
}

/// Maps socket timeouts to [`Error::Timeout`] and anything else to [`Error::Io`].
fn io_error(what: String, timeout: Duration, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout {
            what,
            after: timeout,
        },
        io::ErrorKind::InvalidData => Error::Protocol(format!("{what}: {e}")),
        _ => Error::io(what, e),
    }
}

/// The `process_id` field of an `INFO server` reply.
fn info_field<'a>(info: &'a str, key: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

/// One readiness probe: PING answers PONG and `INFO server` names our child's pid.
fn probe(addr: SocketAddr, pid: u32) -> Probe {
    let mut conn = match RespConn::connect(addr, PROBE_TIMEOUT) {
        Ok(c) => c,
        Err(e) => return Probe::NotYet(e.to_string()),
    };
    match conn.command(&["PING"]) {
        Ok(RespValue::Simple(s)) if s == "PONG" => {}
        Ok(other) => return Probe::NotYet(format!("PING answered {other}")),
        Err(e) => return Probe::NotYet(e.to_string()),
    }
    let info = match conn.command(&["INFO", "server"]) {
        Ok(v) => v,
        Err(e) => return Probe::NotYet(e.to_string()),
    };
    let found = info
        .as_str()
        .and_then(|s| info_field(s, "process_id"))
        .map(str::to_owned);
    match found {
        Some(p) if p == pid.to_string() => Probe::Ready,
        Some(p) => Probe::NotYet(format!(
            "{addr} is answered by redis pid {p}, not by our child {pid}"
        )),
        None => Probe::NotYet(format!("INFO server without process_id: {info}")),
    }
}

/// `redis-server` on `127.0.0.1:port` with its data and log (`redis.log`) in `dir`, no persistence, in
/// the foreground (infra.md §1). Append arguments to override any of these.
pub fn base_spec(port: u16, dir: &Path) -> ServerSpec {
    ServerSpec::new("redis", REDIS_SERVER)
        .install_hint(INSTALL_HINT)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .arg("--dir")
        .arg(dir)
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .arg("--logfile")
        .arg(dir.join("redis.log"))
}

/// The readiness probe for a Redis server on `addr` (also for replicas, Sentinel-managed and Cluster
/// nodes, which answer PING the same way): PING answers PONG and `INFO server` names the child's pid.
pub fn ready_probe(addr: SocketAddr) -> ReadyProbe {
    Arc::new(move |pid| probe(addr, pid))
}

/// Builder for a [`RedisServer`] with extra arguments.
#[derive(Debug, Clone, Default)]
pub struct RedisServerBuilder {
    extra: Vec<String>,
    bus: bool,
    tls: Option<TlsFiles>,
}

/// The PEM files of a TLS listener.
#[derive(Debug, Clone)]
struct TlsFiles {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

impl RedisServerBuilder {
    /// Appends a raw argument (later arguments override the defaults, e.g. `--appendonly yes`).
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra.push(arg.into());
        self
    }

    /// Appends raw arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra.extend(args.into_iter().map(Into::into));
        self
    }

    /// `--enable-debug-command local`: Redis 7 refuses `DEBUG SLEEP` and friends without it.
    pub fn enable_debug_command(self) -> Self {
        self.args(["--enable-debug-command", "local"])
    }

    /// `--appendonly yes --appendfsync always`: every acknowledged write survives a kill -9 restart.
    pub fn durable(self) -> Self {
        self.args(["--appendonly", "yes", "--appendfsync", "always"])
    }

    /// Reserves `port + 10000` too, for a Redis Cluster node's bus.
    pub fn with_cluster_bus(mut self) -> Self {
        self.bus = true;
        self
    }

    /// Adds a TLS listener on a second reserved port (`--tls-port`), serving `ca`'s server
    /// certificate, clients not asked for certificates (`--tls-auth-clients no`). The plain port stays
    /// open for readiness, [`RedisServer::command`] and the like; clients under test use
    /// [`RedisServer::tls_url`].
    pub fn tls(mut self, ca: &crate::tls::TestCa) -> Self {
        self.tls = Some(TlsFiles {
            cert: ca.server_cert().to_path_buf(),
            key: ca.server_key().to_path_buf(),
            ca: ca.ca_cert().to_path_buf(),
        });
        self
    }

    /// Starts the server and waits until it answers PING and reports our child's pid.
    pub fn start(self) -> Result<RedisServer> {
        let lease = if self.bus {
            ports::reserve_with_bus()?
        } else {
            ports::reserve()?
        };
        let port = lease.port();
        let addr = lease.addr();
        let dir = process::temp_dir("redis")?;
        let mut spec = base_spec(port, dir.path());
        let mut leases = vec![lease];
        let mut tls_addr = None;
        if let Some(files) = &self.tls {
            let tls_lease = ports::reserve()?;
            tls_addr = Some(tls_lease.addr());
            spec = spec
                .args(["--tls-port", &tls_lease.port().to_string()])
                .arg("--tls-cert-file")
                .arg(&files.cert)
                .arg("--tls-key-file")
                .arg(&files.key)
                .arg("--tls-ca-cert-file")
                .arg(&files.ca)
                .args(["--tls-auth-clients", "no"]);
            leases.push(tls_lease);
        }
        let spec = spec.args(self.extra);
        let process = ServerProcess::spawn(spec, dir, leases, ready_probe(addr))?;
        Ok(RedisServer {
            process,
            addr,
            tls_addr,
        })
    }

    /// [`start`](Self::start), panicking with the error (which carries the server's log tail). For tests.
    pub fn start_or_panic(self) -> RedisServer {
        match self.start() {
            Ok(server) => server,
            Err(e) => panic!("starting redis-server failed: {e}"),
        }
    }
}

/// A `redis-server` owned by a test: `--save '' --appendonly no` unless the builder says otherwise,
/// bound to 127.0.0.1 on a reserved port, data and log in its own temp dir. Dropping it kills it.
#[derive(Debug)]
pub struct RedisServer {
    process: ServerProcess,
    addr: SocketAddr,
    tls_addr: Option<SocketAddr>,
}

impl RedisServer {
    /// A builder for extra arguments.
    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }

    /// Starts a plain server (no persistence).
    pub fn start() -> Result<RedisServer> {
        Self::builder().start()
    }

    /// [`start`](Self::start), panicking with the log tail on failure. For tests.
    pub fn start_or_panic() -> RedisServer {
        Self::builder().start_or_panic()
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// `rediss://127.0.0.1:<tls port>`, if started with [`RedisServerBuilder::tls`].
    pub fn tls_url(&self) -> Option<String> {
        self.tls_addr.map(|a| format!("rediss://{a}"))
    }

    /// The TLS listener's address, if started with [`RedisServerBuilder::tls`].
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_addr
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The Cluster bus port, if it was reserved with [`RedisServerBuilder::with_cluster_bus`].
    pub fn bus_port(&self) -> Option<u16> {
        self.process.leases().first().and_then(PortLease::bus_port)
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's pid (changes on restart).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The data dir (`--dir`).
    pub fn dir(&self) -> &Path {
        self.process.dir()
    }

    /// The generic process handle.
    pub fn process(&self) -> &ServerProcess {
        &self.process
    }

    /// The generic process handle, for operations this type does not wrap.
    pub fn process_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// kill -9 (the data dir and port stay reserved for [`restart`](Self::restart)).
    pub fn kill9(&mut self) -> Result<()> {
        self.process.kill9()
    }

    /// Starts again on the same port and data dir and waits until ready (kills it first if running).
    pub fn restart(&mut self) -> Result<()> {
        self.process.restart()
    }

    /// SIGSTOP: connections are accepted by the kernel but nothing is answered.
    pub fn pause(&mut self) -> Result<()> {
        self.process.pause()
    }

    /// SIGCONT.
    pub fn resume(&mut self) -> Result<()> {
        self.process.resume()
    }

    /// Graceful stop (SIGTERM, then SIGKILL after a grace period).
    pub fn stop(&mut self) -> Result<()> {
        self.process.stop().map(|_| ())
    }

    /// The last `n` lines of the server's log.
    pub fn log_tail(&self, n: usize) -> String {
        self.process.log_tail(n)
    }

    /// A new connection with `timeout` for connect, reads and writes.
    pub fn connect(&self, timeout: Duration) -> Result<RespConn> {
        RespConn::connect(self.addr, timeout)
    }

    /// Runs one command on a fresh connection (5 s timeout). Error replies are `Ok(RespValue::Error)`.
    pub fn command(&self, args: &[&str]) -> Result<RespValue> {
        self.command_timeout(args, COMMAND_TIMEOUT)
    }

    /// Like [`command`](Self::command) with a chosen timeout; a paused server yields [`Error::Timeout`].
    pub fn command_timeout(&self, args: &[&str], timeout: Duration) -> Result<RespValue> {
        self.connect(timeout)?.command(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> io::Result<RespValue> {
        read_value(&mut io::BufReader::new(bytes))
    }

    #[test]
    fn encodes_commands() {
        assert_eq!(
            encode(&["SET", "k", ""]),
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n"
        );
    }

    #[test]
    fn parses_every_reply_kind() {
        assert_eq!(
            parse(b"+PONG\r\n").unwrap(),
            RespValue::Simple("PONG".into())
        );
        assert_eq!(
            parse(b"-ERR no\r\n").unwrap(),
            RespValue::Error("ERR no".into())
        );
        assert_eq!(parse(b":-7\r\n").unwrap(), RespValue::Int(-7));
        assert_eq!(parse(b"$-1\r\n").unwrap(), RespValue::Nil);
        assert_eq!(parse(b"*-1\r\n").unwrap(), RespValue::Nil);
        assert_eq!(
            parse(b"$5\r\na\r\nbc\r\n").unwrap(),
            RespValue::Bulk(b"a\r\nbc".to_vec())
        );
        assert_eq!(
            parse(b"*2\r\n:1\r\n*1\r\n$0\r\n\r\n").unwrap(),
            RespValue::Array(vec![
                RespValue::Int(1),
                RespValue::Array(vec![RespValue::Bulk(Vec::new())])
            ])
        );
    }

    #[test]
    fn rejects_garbage() {
        assert!(parse(b"?x\r\n").is_err());
        assert!(parse(b":x\r\n").is_err());
        assert!(parse(b"$3\r\nab").is_err());
        assert!(parse(b"").is_err());
        let deep = "*1\r\n".repeat(MAX_DEPTH + 2);
        assert!(parse(deep.as_bytes()).is_err());
    }

    #[test]
    fn finds_info_fields() {
        let info = "# Server\r\nredis_version:7.0.15\r\nprocess_id:4242\r\n";
        assert_eq!(info_field(info, "process_id"), Some("4242"));
        assert_eq!(info_field(info, "run_id"), None);
    }
}
