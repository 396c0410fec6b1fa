//! A MariaDB server for tests ([`MariaDbServer`]): `mariadb-install-db` into its own temp datadir, then
//! `mariadbd` on a reserved loopback port with its own unix socket, killed (process group and all) on drop.
//!
//! * **Never the system server.** Both commands get `--no-defaults`, so nothing of `/etc/mysql/*.cnf`
//!   (the system socket under `/run/mysqld`, port 3306) is read; the datadir, socket, pid file and log
//!   live in the server's temp dir.
//! * **Root.** As root, both commands need `--user=root` (otherwise mariadbd refuses to start); as another
//!   user they run as that user.
//! * **Accounts.** `root@localhost`, `root@127.0.0.1` and `root@::1` exist with no password
//!   (`--auth-root-authentication-method=normal`); [`MariaDbServer::url`] uses root over TCP.
//! * **Readiness.** The TCP port's listening socket belongs to our child (so a server some other test left
//!   on the port is never mistaken for ours) and it sends the protocol-10 greeting.
//! * **Faults.** kill -9 and restart on the same datadir (InnoDB recovers committed rows: infra.md §6),
//!   SIGSTOP/SIGCONT.
//!
//! SQL is run with the `mariadb` command-line client ([`MariaDbServer::sql`]), so the test kit needs no
//! driver of its own and interop tests use the client users have.

use std::io::Read as _;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::ports;
use crate::process::{self, Probe, ReadyProbe, ServerProcess, ServerSpec};

/// The server binary (Debian installs it outside a normal user's PATH).
pub const MARIADBD: &str = "/usr/sbin/mariadbd";
/// Creates the system tables of a fresh datadir.
pub const INSTALL_DB: &str = "mariadb-install-db";
/// The command-line client.
pub const CLIENT: &str = "mariadb";
/// Shown when a MariaDB program is missing.
pub const INSTALL_HINT: &str =
    "install it with `apt-get install -y mariadb-server mariadb-client` (or run scripts/setup.sh)";
/// The database every test server has (empty at start); [`MariaDbServer::url`] names it.
pub const DATABASE: &str = "distlock";
/// Per-probe I/O timeout.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

fn missing(program: &str) -> Error {
    Error::MissingBinary {
        program: program.into(),
        hint: INSTALL_HINT.into(),
    }
}

/// Runs `mariadb-install-db` into `datadir` (about half a second). Its bootstrap server gets a tmpdir
/// of its own: with the default `/tmp`, installs running in parallel trip over each other's temporary
/// tables ("Could not remove temporary table", "Unknown table 'mysql.tmp_user_sys'").
fn install_db(datadir: &Path, tmpdir: &Path) -> Result<()> {
    std::fs::create_dir_all(tmpdir).map_err(|e| Error::io("creating the server's tmpdir", e))?;
    let mut cmd = Command::new(INSTALL_DB);
    cmd.arg("--no-defaults")
        .arg(format!("--datadir={}", datadir.display()))
        .arg(format!("--tmpdir={}", tmpdir.display()))
        .args([
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
        ]);
    if is_root() {
        cmd.arg("--user=root");
    }
    let out = cmd.output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            missing(INSTALL_DB)
        } else {
            Error::io("running mariadb-install-db", e)
        }
    })?;
    if !out.status.success() {
        return Err(Error::Protocol(format!(
            "mariadb-install-db failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(())
}

/// Reads the server's first packet and checks it is a protocol-10 greeting.
fn greeting(addr: SocketAddr) -> Result<()> {
    let mut stream = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT)
        .map_err(|e| Error::io(format!("connecting to {addr}"), e))?;
    stream
        .set_read_timeout(Some(PROBE_TIMEOUT))
        .map_err(|e| Error::io("setting a socket timeout", e))?;
    // 3-byte length, 1-byte sequence, then the protocol version.
    let mut head = [0u8; 5];
    stream
        .read_exact(&mut head)
        .map_err(|e| Error::io(format!("reading the greeting of {addr}"), e))?;
    if head[4] == 10 {
        Ok(())
    } else {
        Err(Error::Protocol(format!(
            "{addr} sent {head:?}, not a protocol-10 greeting"
        )))
    }
}

/// The readiness probe: our child listens on `addr` and greets.
pub fn ready_probe(addr: SocketAddr) -> ReadyProbe {
    Arc::new(move |pid| {
        if !crate::etcd::listens_on(pid, addr.port()) {
            return Probe::NotYet(format!(
                "{addr} is not (yet) listened on by our child {pid}"
            ));
        }
        match greeting(addr) {
            Ok(()) => Probe::Ready,
            Err(e) => Probe::NotYet(e.to_string()),
        }
    })
}

/// Builder for a [`MariaDbServer`].
#[derive(Debug, Clone, Default)]
pub struct MariaDbServerBuilder {
    args: Vec<String>,
    tls: bool,
}

impl MariaDbServerBuilder {
    /// Appends a `mariadbd` option, e.g. `--wait-timeout=5`.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// TLS on: `ca`'s server certificate (for `localhost` and `127.0.0.1`) and key, and its CA as
    /// `--ssl-ca`. The files are read where `ca` keeps them, so keep `ca` alive while the server runs.
    /// Plain connections are still accepted unless [`require_secure_transport`](Self::require_secure_transport).
    pub fn tls(mut self, ca: &crate::tls::TestCa) -> Self {
        self.args.extend([
            format!("--ssl-cert={}", ca.server_cert().display()),
            format!("--ssl-key={}", ca.server_key().display()),
            format!("--ssl-ca={}", ca.ca_cert().display()),
        ]);
        self.tls = true;
        self
    }

    /// `--require-secure-transport=ON`: the server refuses every TCP session without TLS, so a client
    /// that gets in is encrypted. Needs [`tls`](Self::tls); [`MariaDbServer::client`] then speaks TLS.
    pub fn require_secure_transport(mut self) -> Self {
        self.args.push("--require-secure-transport=ON".into());
        self
    }

    /// Installs a datadir and starts the server; waits until it is ours and greets.
    pub fn start(self) -> Result<MariaDbServer> {
        let dir = process::temp_dir("mariadb")?;
        let datadir = dir.path().join("data");
        let tmpdir = dir.path().join("tmp");
        install_db(&datadir, &tmpdir)?;
        let lease = ports::reserve()?;
        let addr = lease.addr();
        let socket = dir.path().join("sock");
        let mut spec = ServerSpec::new("mariadb", MARIADBD)
            .install_hint(INSTALL_HINT)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", datadir.display()))
            .arg(format!("--port={}", addr.port()))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--tmpdir={}", tmpdir.display()))
            .arg(format!(
                "--pid-file={}",
                dir.path().join("mysqld.pid").display()
            ))
            .args([
                "--skip-log-bin",
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=32M",
                "--innodb-log-file-size=16M",
                "--innodb-flush-log-at-trx-commit=2",
                "--performance-schema=OFF",
                "--max-connections=500",
            ])
            .args(self.args);
        let tls = self.tls;
        if is_root() {
            spec = spec.arg("--user=root");
        }
        let process = ServerProcess::spawn(spec, dir, vec![lease], ready_probe(addr))?;
        let server = MariaDbServer {
            process,
            addr,
            socket,
            tls,
        };
        server.sql(&format!("CREATE DATABASE IF NOT EXISTS {DATABASE}"))?;
        Ok(server)
    }

    /// [`start`](Self::start), panicking with the log tail on failure. For tests.
    pub fn start_or_panic(self) -> MariaDbServer {
        match self.start() {
            Ok(server) => server,
            Err(e) => panic!("starting MariaDB failed: {e}"),
        }
    }
}

/// A MariaDB server owned by a test. Dropping it kills it.
#[derive(Debug)]
pub struct MariaDbServer {
    process: ServerProcess,
    addr: SocketAddr,
    socket: PathBuf,
    /// Started with TLS: the `mariadb` client speaks it (unverified: the tests check distlock's side).
    tls: bool,
}

impl MariaDbServer {
    /// A builder (extra server options).
    pub fn builder() -> MariaDbServerBuilder {
        MariaDbServerBuilder::default()
    }

    /// Starts a server with the defaults.
    pub fn start() -> Result<MariaDbServer> {
        Self::builder().start()
    }

    /// [`start`](Self::start), panicking with the log tail on failure. For tests.
    pub fn start_or_panic() -> MariaDbServer {
        Self::builder().start_or_panic()
    }

    /// `mysql://root@127.0.0.1:<port>/distlock` (root has no password; [`DATABASE`] is created at start).
    pub fn url(&self) -> String {
        self.url_via(self.addr)
    }

    /// The same URL through another address (a fault proxy in front of the server).
    pub fn url_via(&self, addr: SocketAddr) -> String {
        format!("mysql://root@{addr}/{DATABASE}")
    }

    /// The TCP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The unix socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The server's pid (changes on restart).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The temp dir (datadir in `data/`, log in `mariadb.log`).
    pub fn dir(&self) -> &Path {
        self.process.dir()
    }

    /// The generic process handle.
    pub fn process_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// kill -9 (datadir and port stay for [`restart`](Self::restart)).
    pub fn kill9(&mut self) -> Result<()> {
        self.process.kill9()
    }

    /// Starts again on the same port and datadir and waits until ready.
    pub fn restart(&mut self) -> Result<()> {
        self.process.restart()
    }

    /// SIGSTOP.
    pub fn pause(&mut self) -> Result<()> {
        self.process.pause()
    }

    /// SIGCONT.
    pub fn resume(&mut self) -> Result<()> {
        self.process.resume()
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        self.process.log_tail(n)
    }

    /// A `mariadb` client command for this server as root over TCP (batch mode, no column names), for
    /// tests that need a second session of their own (`.spawn()` it to hold a lock while it sleeps).
    pub fn client(&self) -> Command {
        let mut cmd = Command::new(CLIENT);
        cmd.args(["--no-defaults", "--protocol=tcp", "-h127.0.0.1"])
            .arg(format!("-P{}", self.addr.port()))
            .args(["-uroot", "--batch", "--skip-column-names"]);
        if self.tls {
            cmd.arg("--ssl");
        }
        cmd
    }

    /// Runs `sql` with the `mariadb` client to completion and returns its stdout (tab-separated rows).
    pub fn sql(&self, sql: &str) -> Result<String> {
        let out = self.client().arg("-e").arg(sql).output().map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                missing(CLIENT)
            } else {
                Error::io("running the mariadb client", e)
            }
        })?;
        if !out.status.success() {
            return Err(Error::Protocol(format!(
                "mariadb -e {sql:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]
    use super::*;

    #[test]
    fn starts_answers_and_restarts() {
        let mut server = MariaDbServer::start_or_panic();
        assert_eq!(server.sql("SELECT 1").expect("select").trim(), "1");
        server
            .sql("CREATE TABLE test.t (x INT) ENGINE=InnoDB")
            .or_else(|_| {
                server.sql("CREATE DATABASE test")?;
                server.sql("CREATE TABLE test.t (x INT) ENGINE=InnoDB")
            })
            .expect("create");
        server.sql("INSERT INTO test.t VALUES (7)").expect("insert");
        server.kill9().expect("kill");
        server.restart().expect("restart");
        assert_eq!(
            server.sql("SELECT x FROM test.t").expect("select").trim(),
            "7"
        );
    }
}
