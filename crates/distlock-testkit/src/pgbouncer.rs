//! A PgBouncer of a test's own in front of a [`PostgresServer`]: its config and auth file in a temp
//! dir, a reserved loopback port, `pool_mode=transaction` (the pooler distlock's session modes must
//! refuse), started directly as a child (never the system's `pgbouncer` service), ready when it
//! accepts connections.
//!
//! ```no_run
//! let server = distlock_testkit::postgres::PostgresServer::start()?;
//! let bouncer = distlock_testkit::pgbouncer::PgBouncer::start(&server)?;
//! // postgres://postgres:<pw>@127.0.0.1:<bouncer port>/postgres?mode=lease
//! let url = bouncer.url();
//! # Ok::<(), distlock_testkit::Error>(())
//! ```

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::ports;
use crate::postgres::{chown, server_user, PostgresServer, PASSWORD, SUPERUSER};
use crate::process::{self, Probe, ReadyProbe, ServerProcess, ServerSpec};

/// Where Debian installs it.
pub const DEFAULT_BIN: &str = "/usr/sbin/pgbouncer";
/// How to get it.
pub const INSTALL_HINT: &str =
    "apt-get install -y pgbouncer (scripts/setup.sh does), or set DISTLOCK_PGBOUNCER";

/// The `pgbouncer` binary: `$DISTLOCK_PGBOUNCER`, else [`DEFAULT_BIN`].
pub fn bin() -> PathBuf {
    std::env::var_os("DISTLOCK_PGBOUNCER")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_BIN))
}

/// A running PgBouncer owned by a test. Dropping it kills it and deletes its directory.
#[derive(Debug)]
pub struct PgBouncer {
    process: ServerProcess,
    addr: SocketAddr,
}

impl PgBouncer {
    /// A transaction-mode PgBouncer in front of `server`'s `postgres` database, logging in as the
    /// superuser with the test password (SCRAM on both sides).
    pub fn start(server: &PostgresServer) -> Result<PgBouncer> {
        Self::start_with(server, "transaction")
    }

    /// As [`start`](Self::start) with another `pool_mode` (`session`, `transaction`, `statement`).
    pub fn start_with(server: &PostgresServer, pool_mode: &str) -> Result<PgBouncer> {
        let user = server_user()?;
        let dir = process::temp_dir("pgbouncer")?;
        chown(dir.path(), user)?;
        let lease = ports::reserve()?;
        let addr = lease.addr();
        let auth = dir.path().join("userlist.txt");
        let ini = dir.path().join("pgbouncer.ini");
        let upstream = server.addr();
        let config = format!(
            "[databases]\n\
             postgres = host={host} port={port} dbname=postgres\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {listen}\n\
             unix_socket_dir =\n\
             auth_type = scram-sha-256\n\
             auth_file = {auth}\n\
             pool_mode = {pool_mode}\n\
             max_client_conn = 500\n\
             default_pool_size = 50\n\
             ignore_startup_parameters = extra_float_digits,options\n\
             server_tls_sslmode = disable\n",
            host = upstream.ip(),
            port = upstream.port(),
            listen = addr.port(),
            auth = auth.display(),
        );
        for (path, text) in [
            (&auth, format!("\"{SUPERUSER}\" \"{PASSWORD}\"\n")),
            (&ini, config),
        ] {
            std::fs::write(path, text)
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
            chown(path, user)?;
        }
        let mut spec = ServerSpec::new("pgbouncer", bin().as_os_str())
            .install_hint(INSTALL_HINT)
            .arg(&ini);
        if let Some((uid, gid)) = user {
            // PgBouncer refuses to run as root.
            spec = spec.uid(uid).gid(gid);
        }
        let process = ServerProcess::spawn(spec, dir, vec![lease], ready_probe(addr))?;
        Ok(PgBouncer { process, addr })
    }

    /// [`start`](Self::start), panicking with the reason (for tests).
    pub fn start_or_panic(server: &PostgresServer) -> PgBouncer {
        match Self::start(server) {
            Ok(bouncer) => bouncer,
            Err(e) => panic!("could not start PgBouncer: {e}"),
        }
    }

    /// `postgres://postgres:<password>@127.0.0.1:<port>/postgres`: the server's URL, through PgBouncer.
    pub fn url(&self) -> String {
        format!("postgres://{SUPERUSER}:{PASSWORD}@{}/postgres", self.addr)
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        self.process.log_tail(n)
    }
}

/// Ready when our child listens on `addr` and a TCP connection is accepted.
fn ready_probe(addr: SocketAddr) -> ReadyProbe {
    Arc::new(move |pid| {
        if !crate::etcd::listens_on(pid, addr.port()) {
            return Probe::NotYet(format!(
                "{addr} is not (yet) listened on by our child {pid}"
            ));
        }
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(_) => Probe::Ready,
            Err(e) => Probe::NotYet(format!("connecting to {addr}: {e}")),
        }
    })
}
