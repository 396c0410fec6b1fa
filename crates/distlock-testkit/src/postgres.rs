//! A PostgreSQL 15 server for tests: `initdb` into its own temp dir, `postgres` on a reserved loopback
//! port with its unix socket in the same dir, killed (with its whole process group) on drop.
//!
//! * **Never the system server.** The machine may run PostgreSQL on :5432; this one listens only on
//!   127.0.0.1 at a reserved port and its socket lives in the temp dir.
//! * **Not as root.** PostgreSQL refuses root: when the tests run as root, the server runs as the
//!   `postgres` user (made by the postgresql-15 package), else `nobody`; the numbers are read from
//!   `/etc/passwd` and set with `Command::uid` (no `su`/`runuser`, which fork, so the pid is the
//!   postmaster's).
//! * **Authentication.** The superuser `postgres` has the password [`PASSWORD`]; TCP connections
//!   use `scram-sha-256` (so a wrong password is refused), the unix socket `trust`.
//! * **Short timers.** `fsync=off` (the page cache survives a process kill), `max_connections=300`
//!   (every held advisory or row lock is a connection).
//!
//! Binaries: `$DISTLOCK_PG_BIN` if set, else `/usr/lib/postgresql/15/bin`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ports::{self, PortLease};
use crate::process::{self, Probe, ReadyProbe, ServerProcess, ServerSpec};
use crate::tls::TestCa;

/// Where the PostgreSQL 15 binaries are installed on Debian.
pub const DEFAULT_BIN_DIR: &str = "/usr/lib/postgresql/15/bin";
/// Shown when they are missing.
pub const INSTALL_HINT: &str =
    "install it with `apt-get install -y postgresql-15 postgresql-client-15` (or run scripts/setup.sh)";
/// The superuser's password on TCP.
pub const PASSWORD: &str = "distlock-test-pw";
/// The superuser.
pub const SUPERUSER: &str = "postgres";

/// The directory with `initdb` and `postgres`.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("DISTLOCK_PG_BIN")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_BIN_DIR))
}

/// `(uid, gid)` to run the server as: `None` when not root; the `postgres` user, else `nobody`.
pub(crate) fn server_user() -> Result<Option<(u32, u32)>> {
    if !rustix::process::getuid().is_root() {
        return Ok(None);
    }
    let passwd =
        std::fs::read_to_string("/etc/passwd").map_err(|e| Error::io("reading /etc/passwd", e))?;
    for wanted in ["postgres", "nobody"] {
        for line in passwd.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() > 3 && fields[0] == wanted {
                if let (Ok(uid), Ok(gid)) = (fields[2].parse(), fields[3].parse()) {
                    return Ok(Some((uid, gid)));
                }
            }
        }
    }
    Err(Error::Protocol(
        "running as root, and neither a `postgres` nor a `nobody` user exists to run PostgreSQL as"
            .into(),
    ))
}

pub(crate) fn chown(path: &Path, user: Option<(u32, u32)>) -> Result<()> {
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .map_err(|e| Error::io(format!("chown {}", path.display()), e))?;
    }
    Ok(())
}

/// A running test server. Dropping it kills the server and deletes its directory.
#[derive(Debug)]
pub struct PostgresServer {
    process: ServerProcess,
    addr: SocketAddr,
}

impl PostgresServer {
    /// initdb + start on a reserved port; ready when it accepts a login.
    pub fn start() -> Result<PostgresServer> {
        Self::start_with(&[])
    }

    /// As [`start`](Self::start), with extra `-c name=value` settings.
    pub fn start_with(settings: &[&str]) -> Result<PostgresServer> {
        Self::start_inner(settings, None)
    }

    /// As [`start`](Self::start), with TLS on (`ssl=on`) serving `ca`'s server certificate (for
    /// `localhost` and `127.0.0.1`); plain connections are still accepted, as a default `pg_hba.conf`
    /// allows both.
    pub fn start_tls(ca: &TestCa, settings: &[&str]) -> Result<PostgresServer> {
        Self::start_inner(settings, Some(ca))
    }

    fn start_inner(settings: &[&str], tls: Option<&TestCa>) -> Result<PostgresServer> {
        let bin = bin_dir();
        let initdb = bin.join("initdb");
        let postgres = bin.join("postgres");
        for program in [&initdb, &postgres] {
            if !program.is_file() {
                return Err(Error::MissingBinary {
                    program: program.display().to_string(),
                    hint: INSTALL_HINT.into(),
                });
            }
        }
        let user = server_user()?;
        let dir = process::temp_dir("pg")?;
        chown(dir.path(), user)?;
        let data = dir.path().join("data");
        let pwfile = dir.path().join("pw");
        std::fs::write(&pwfile, PASSWORD).map_err(|e| Error::io("writing the password file", e))?;
        chown(&pwfile, user)?;
        let mut init = Command::new(&initdb);
        init.arg("-D")
            .arg(&data)
            .args([
                "-U",
                SUPERUSER,
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
            ])
            .arg(format!("--pwfile={}", pwfile.display()))
            .args(["--no-sync", "--no-instructions", "-E", "UTF8", "--locale=C"]);
        if let Some((uid, gid)) = user {
            std::os::unix::process::CommandExt::uid(&mut init, uid);
            std::os::unix::process::CommandExt::gid(&mut init, gid);
        }
        let out = init
            .output()
            .map_err(|e| Error::io(format!("running {}", initdb.display()), e))?;
        if !out.status.success() {
            return Err(Error::Protocol(format!(
                "initdb failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let lease: PortLease = ports::reserve()?;
        let port = lease.port();
        let addr = lease.addr();
        let mut spec = ServerSpec::new("postgres", postgres.as_os_str())
            .install_hint(INSTALL_HINT)
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", dir.path().display()))
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c", "shared_buffers=16MB", "-c", "max_connections=300"])
            .args(["-c", "log_min_messages=warning"])
            .env_remove("PGDATA")
            .env_remove("PGPORT");
        for setting in settings {
            spec = spec.args(["-c", setting]);
        }
        if let Some(ca) = tls {
            // Copies the server owns: PostgreSQL refuses a key file others can read or it does not own.
            let cert = dir.path().join("server.pem");
            let key = dir.path().join("server.key");
            for (from, to) in [(ca.server_cert(), &cert), (ca.server_key(), &key)] {
                std::fs::copy(from, to)
                    .map_err(|e| Error::io(format!("copying {}", from.display()), e))?;
                chown(to, user)?;
            }
            std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .map_err(|e| Error::io("restricting the server key", e))?;
            spec = spec
                .args(["-c", "ssl=on"])
                .arg("-c")
                .arg(format!("ssl_cert_file={}", cert.display()))
                .arg("-c")
                .arg(format!("ssl_key_file={}", key.display()));
        }
        if let Some((uid, gid)) = user {
            spec = spec.uid(uid).gid(gid);
        }
        let socket_dir = dir.path().to_path_buf();
        let process = ServerProcess::spawn(spec, dir, vec![lease], ready_probe(socket_dir, port))?;
        Ok(PostgresServer { process, addr })
    }

    /// [`start`](Self::start), panicking with the reason (for tests).
    pub fn start_or_panic() -> PostgresServer {
        match Self::start() {
            Ok(server) => server,
            Err(e) => panic!("could not start PostgreSQL: {e}"),
        }
    }

    /// `postgres://postgres:<password>@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        self.url_for(self.addr)
    }

    /// The same URL through another address (a fault proxy in front of the server).
    pub fn url_for(&self, addr: SocketAddr) -> String {
        format!("postgres://{SUPERUSER}:{PASSWORD}@{addr}/postgres")
    }

    /// The TCP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The directory holding the unix socket (`host=` of a socket URL).
    pub fn socket_dir(&self) -> &Path {
        self.process.dir()
    }

    /// The postmaster's pid.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The server process, for faults (kill9, restart, pause).
    pub fn process_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// Runs SQL with `psql` over the unix socket as the superuser; returns its unaligned, tuples-only
    /// output, trimmed. A failing statement is an error carrying psql's message.
    pub fn psql(&self, sql: &str) -> Result<String> {
        let out = self
            .psql_command(sql)
            .output()
            .map_err(|e| Error::io("running psql", e))?;
        if !out.status.success() {
            return Err(Error::Protocol(format!(
                "psql failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// A `psql` command over the unix socket as the superuser, running `sql` and stopping on the first
    /// error, for tests that keep it running (a session that holds a lock).
    pub fn psql_command(&self, sql: &str) -> Command {
        let mut cmd = Command::new("psql");
        cmd.args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
            .arg("-h")
            .arg(self.socket_dir())
            .args([
                "-p",
                &self.addr.port().to_string(),
                "-U",
                SUPERUSER,
                "-d",
                "postgres",
            ])
            .args(["-c", sql])
            .env_remove("PGPASSWORD")
            .env_remove("PGSERVICE")
            .env_remove("PGOPTIONS");
        cmd
    }
}

/// Ready when `pg_isready` over the socket says the server accepts connections and the data dir's
/// `postmaster.pid` names our child.
fn ready_probe(socket_dir: PathBuf, port: u16) -> ReadyProbe {
    let pg_isready = bin_dir().join("pg_isready");
    Arc::new(move |pid| {
        let pidfile = socket_dir.join("data/postmaster.pid");
        match std::fs::read_to_string(&pidfile) {
            Ok(text) if text.lines().next() == Some(pid.to_string().as_str()) => {}
            Ok(_) => return Probe::NotYet("postmaster.pid names another process".into()),
            Err(e) => return Probe::NotYet(format!("no postmaster.pid yet: {e}")),
        }
        let status = Command::new(&pg_isready)
            .arg("-q")
            .arg("-h")
            .arg(&socket_dir)
            .args([
                "-p",
                &port.to_string(),
                "-t",
                "1",
                "-U",
                SUPERUSER,
                "-d",
                "postgres",
            ])
            .status();
        match status {
            Ok(s) if s.success() => Probe::Ready,
            Ok(s) => Probe::NotYet(format!("pg_isready: {s}")),
            Err(e) => Probe::NotYet(format!("pg_isready: {e}")),
        }
    })
}
