//! etcd 3.4 servers for tests: a single node ([`EtcdServer`]) and a 3-member cluster ([`EtcdCluster`]),
//! each member on two reserved loopback ports (client, peer) with its data in its own temp dir.
//!
//! * **Timers.** `--heartbeat-interval 20 --election-timeout 200` by default, so the minimum lease TTL
//!   (1.5 × the election timeout, rounded up to whole seconds: infra.md §4) is 1 s and short leases are
//!   honoured. [`EtcdServer::builder`] can choose safer ones (50/500) for a loaded machine.
//! * **Readiness.** `GET /health` over a plain `TcpStream` answers `"health":"true"` (a leader exists and
//!   a read went through), and the client port's listening socket belongs to our child (its inode is one
//!   of the child's fds), so an etcd some other test left on the port is never mistaken for ours.
//! * **Faults.** kill -9 and restart on the same data dir (etcd fsyncs its WAL, so acknowledged writes
//!   survive), SIGSTOP/SIGCONT, and per-member kill/restart in a cluster (a restarted member rejoins with
//!   `--initial-cluster-state existing`).
//!
//! `ETCD_*` variables are removed from the environment, since etcd reads its flags from them.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::ports::{self, PortLease};
use crate::process::{self, Probe, ReadyProbe, ServerProcess, ServerSpec};

/// The server binary.
pub const ETCD: &str = "etcd";
/// The command-line client (the interop tests run `etcdctl lock`).
pub const ETCDCTL: &str = "etcdctl";
/// Shown when etcd is missing.
pub const INSTALL_HINT: &str =
    "install it with `apt-get install -y etcd-server etcd-client` (or run scripts/setup.sh)";
/// Per-probe I/O timeout, short so the readiness deadline is checked often.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a cluster gets to elect a leader and report every member healthy (the first election on
/// loopback comes ~2.2 s after start: infra.md §4).
const CLUSTER_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Raft timers of a test server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Timers {
    /// `--heartbeat-interval`, milliseconds.
    pub heartbeat_ms: u32,
    /// `--election-timeout`, milliseconds.
    pub election_ms: u32,
}

impl Timers {
    /// 20/200 ms: leases of 1 s are honoured; fine on an idle machine.
    pub const FAST: Timers = Timers {
        heartbeat_ms: 20,
        election_ms: 200,
    };
    /// 50/500 ms: fewer spurious elections on a loaded machine; the minimum TTL is still 1 s.
    pub const SAFE: Timers = Timers {
        heartbeat_ms: 50,
        election_ms: 500,
    };

    /// The shortest lease TTL such a server grants: 1.5 × the election timeout, rounded up to seconds.
    pub fn min_ttl(&self) -> Duration {
        Duration::from_secs(u64::from(self.election_ms * 3 / 2).div_ceil(1000).max(1))
    }
}

impl Default for Timers {
    fn default() -> Self {
        Timers::SAFE
    }
}

/// One member's fixed identity: name, ports, data dir.
#[derive(Debug)]
struct Member {
    name: String,
    client: PortLease,
    peer: PortLease,
}

impl Member {
    fn new(name: String) -> Result<Member> {
        Ok(Member {
            name,
            client: ports::reserve()?,
            peer: ports::reserve()?,
        })
    }

    fn client_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client.port())
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer.port())
    }
}

fn spec(
    member: &Member,
    data_dir: &Path,
    initial_cluster: &str,
    token: &str,
    state: &str,
    timers: Timers,
) -> ServerSpec {
    let mut spec = ServerSpec::new(format!("etcd-{}", member.name), ETCD)
        .install_hint(INSTALL_HINT)
        .args(["--name", &member.name])
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--listen-client-urls", &member.client_url()])
        .args(["--advertise-client-urls", &member.client_url()])
        .args(["--listen-peer-urls", &member.peer_url()])
        .args(["--initial-advertise-peer-urls", &member.peer_url()])
        .args(["--initial-cluster", initial_cluster])
        .args(["--initial-cluster-token", token])
        .args(["--initial-cluster-state", state])
        .args(["--heartbeat-interval", &timers.heartbeat_ms.to_string()])
        .args(["--election-timeout", &timers.election_ms.to_string()])
        .args(["--logger", "zap", "--log-outputs", "stderr"]);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("ETCD_") {
            spec = spec.env_remove(key);
        }
    }
    spec
}

/// `GET /health` on `addr`: whether the answer says `"health":"true"`.
pub fn health(addr: SocketAddr, timeout: Duration) -> Result<bool> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| Error::io(format!("connecting to {addr}"), e))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| Error::io("setting socket timeouts", e))?;
    stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .map_err(|e| Error::io(format!("GET /health on {addr}"), e))?;
    let mut reply = String::new();
    stream
        .read_to_string(&mut reply)
        .map_err(|e| Error::io(format!("reading /health of {addr}"), e))?;
    Ok(reply.replace(' ', "").contains("\"health\":\"true\""))
}

/// Whether `pid` owns the socket listening on `127.0.0.1:port` (its inode is among the pid's fds).
pub(crate) fn listens_on(pid: u32, port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    let local = format!("0100007F:{port:04X}");
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // local_address, state 0A = LISTEN, inode in column 9.
            (cols.get(1) == Some(&local.as_str()) && cols.get(3) == Some(&"0A"))
                .then(|| cols.get(9).map(|s| format!("socket:[{s}]")))
                .flatten()
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .map(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
            .unwrap_or(false)
    })
}

fn probe(addr: SocketAddr, pid: u32, need_health: bool) -> Probe {
    if !listens_on(pid, addr.port()) {
        return Probe::NotYet(format!(
            "{addr} is not (yet) listened on by our child {pid}"
        ));
    }
    if !need_health {
        return Probe::Ready;
    }
    match health(addr, PROBE_TIMEOUT) {
        Ok(true) => Probe::Ready,
        Ok(false) => Probe::NotYet(format!("{addr}/health is not true yet")),
        Err(e) => Probe::NotYet(e.to_string()),
    }
}

/// The readiness probe of a single node: it is ours and healthy.
pub fn ready_probe(addr: SocketAddr) -> ReadyProbe {
    Arc::new(move |pid| probe(addr, pid, true))
}

/// Builder for an [`EtcdServer`].
#[derive(Debug, Clone, Default)]
pub struct EtcdServerBuilder {
    timers: Option<Timers>,
    tls: Option<TlsFiles>,
}

/// The PEM files of a TLS client listener.
#[derive(Debug, Clone)]
struct TlsFiles {
    cert: PathBuf,
    key: PathBuf,
}

impl EtcdServerBuilder {
    /// Raft timers (default [`Timers::SAFE`]).
    pub fn timers(mut self, timers: Timers) -> Self {
        self.timers = Some(timers);
        self
    }

    /// Adds a second client listener, `https://127.0.0.1:<port>` on its own reserved port, serving
    /// `ca`'s server certificate (`--cert-file --key-file`). No `--trusted-ca-file`: etcd 3.4 then
    /// demands a client certificate even with `--client-cert-auth=false` ("tls: client didn't provide a
    /// certificate"). The plain client URL stays for readiness and [`EtcdServer::etcdctl`]; clients
    /// under test use [`EtcdServer::tls_url`].
    pub fn tls(mut self, ca: &crate::tls::TestCa) -> Self {
        self.tls = Some(TlsFiles {
            cert: ca.server_cert().to_path_buf(),
            key: ca.server_key().to_path_buf(),
        });
        self
    }

    /// Starts the node and waits until it is ours and healthy.
    pub fn start(self) -> Result<EtcdServer> {
        let timers = self.timers.unwrap_or_default();
        let member = Member::new("n1".into())?;
        let dir = process::temp_dir("etcd")?;
        let data = dir.path().join("data");
        let initial = format!("n1={}", member.peer_url());
        let token = format!("t-{}", uuid::Uuid::new_v4().simple());
        let mut spec = spec(&member, &data, &initial, &token, "new", timers);
        let addr = member.client.addr();
        let mut leases = Vec::new();
        let mut tls_addr = None;
        if let Some(files) = &self.tls {
            let tls_lease = ports::reserve()?;
            tls_addr = Some(tls_lease.addr());
            // Repeated flags: the last one wins (Go's flag package).
            let urls = format!(
                "{},https://127.0.0.1:{}",
                member.client_url(),
                tls_lease.port()
            );
            spec = spec
                .args(["--listen-client-urls", &urls])
                .args(["--advertise-client-urls", &urls])
                .arg("--cert-file")
                .arg(&files.cert)
                .arg("--key-file")
                .arg(&files.key);
            leases.push(tls_lease);
        }
        let Member { client, peer, .. } = member;
        leases.splice(0..0, [client, peer]);
        let process = ServerProcess::spawn(spec, dir, leases, ready_probe(addr))?;
        Ok(EtcdServer {
            process,
            addr,
            tls_addr,
            timers,
        })
    }

    /// [`start`](Self::start), panicking with the log tail on failure. For tests.
    pub fn start_or_panic(self) -> EtcdServer {
        match self.start() {
            Ok(server) => server,
            Err(e) => panic!("starting etcd failed: {e}"),
        }
    }
}

/// A single-node etcd owned by a test. Dropping it kills it.
#[derive(Debug)]
pub struct EtcdServer {
    process: ServerProcess,
    addr: SocketAddr,
    tls_addr: Option<SocketAddr>,
    timers: Timers,
}

impl EtcdServer {
    /// A builder (timers, TLS).
    pub fn builder() -> EtcdServerBuilder {
        EtcdServerBuilder::default()
    }

    /// Starts a node with the default timers.
    pub fn start() -> Result<EtcdServer> {
        Self::builder().start()
    }

    /// [`start`](Self::start), panicking with the log tail on failure. For tests.
    pub fn start_or_panic() -> EtcdServer {
        Self::builder().start_or_panic()
    }

    /// `etcd://127.0.0.1:<client port>`.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.addr)
    }

    /// `127.0.0.1:<client port>`, as etcdctl's `--endpoints` takes it.
    pub fn endpoints(&self) -> String {
        self.addr.to_string()
    }

    /// `etcds://127.0.0.1:<TLS client port>`, if started with [`EtcdServerBuilder::tls`].
    pub fn tls_url(&self) -> Option<String> {
        self.tls_addr.map(|a| format!("etcds://{a}"))
    }

    /// The TLS client listener's address, if started with [`EtcdServerBuilder::tls`].
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_addr
    }

    /// The client address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The raft timers it runs with.
    pub fn timers(&self) -> Timers {
        self.timers
    }

    /// The server's pid (changes on restart).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The temp dir (data in `data/`, log in `etcd-n1.log`).
    pub fn dir(&self) -> &Path {
        self.process.dir()
    }

    /// The generic process handle.
    pub fn process_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// kill -9 (data dir and ports stay for [`restart`](Self::restart)).
    pub fn kill9(&mut self) -> Result<()> {
        self.process.kill9()
    }

    /// Starts again on the same ports and data dir and waits until healthy.
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

    /// Runs `etcdctl --endpoints <this> ARGS` to completion and returns its stdout.
    pub fn etcdctl(&self, args: &[&str]) -> Result<String> {
        etcdctl(&self.endpoints(), args)
    }
}

/// Runs `etcdctl --endpoints ENDPOINTS ARGS` (API v3) to completion; fails with its stderr.
pub fn etcdctl(endpoints: &str, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(ETCDCTL)
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", endpoints])
        .args(args)
        .output()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::MissingBinary {
                    program: ETCDCTL.into(),
                    hint: INSTALL_HINT.into(),
                }
            } else {
                Error::io("running etcdctl", e)
            }
        })?;
    if !out.status.success() {
        return Err(Error::Protocol(format!(
            "etcdctl {args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A cluster member.
#[derive(Debug)]
struct Node {
    name: String,
    addr: SocketAddr,
    process: ServerProcess,
}

/// An etcd cluster of `n` members on loopback, one initial cluster token. Dropping it kills them all.
#[derive(Debug)]
pub struct EtcdCluster {
    nodes: Vec<Node>,
    timers: Timers,
}

impl EtcdCluster {
    /// Starts `n` members with the default timers and waits until every member is healthy (which
    /// needs an elected leader).
    pub fn start(n: usize) -> Result<EtcdCluster> {
        Self::start_with(n, Timers::default())
    }

    /// [`start`](Self::start) with chosen timers.
    pub fn start_with(n: usize, timers: Timers) -> Result<EtcdCluster> {
        let members = (1..=n)
            .map(|i| Member::new(format!("n{i}")))
            .collect::<Result<Vec<_>>>()?;
        let initial = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        let token = format!("t-{}", uuid::Uuid::new_v4().simple());
        let mut nodes = Vec::new();
        for member in members {
            let dir = process::temp_dir("etcd")?;
            let data = dir.path().join("data");
            let new = spec(&member, &data, &initial, &token, "new", timers);
            let addr = member.client.addr();
            let name = member.name.clone();
            let Member { client, peer, .. } = member;
            // Members cannot be healthy before a quorum runs: readiness here is only "ours and
            // listening"; health of all is awaited below.
            let probe: ReadyProbe = Arc::new(move |pid| self::probe(addr, pid, false));
            let process = ServerProcess::spawn(new, dir, vec![client, peer], probe)?;
            nodes.push(Node {
                name,
                addr,
                process,
            });
        }
        let cluster = EtcdCluster { nodes, timers };
        cluster.wait_healthy(CLUSTER_READY_TIMEOUT)?;
        Ok(cluster)
    }

    /// [`start`](Self::start), panicking with the error. For tests.
    pub fn start_or_panic(n: usize) -> EtcdCluster {
        match Self::start(n) {
            Ok(c) => c,
            Err(e) => panic!("starting an etcd cluster failed: {e}"),
        }
    }

    /// Waits until every running member reports `/health` true.
    pub fn wait_healthy(&self, timeout: Duration) -> Result<()> {
        let started = Instant::now();
        loop {
            let mut last = String::new();
            let mut all = true;
            for node in self.nodes.iter().filter(|n| n.process.is_running()) {
                match health(node.addr, PROBE_TIMEOUT) {
                    Ok(true) => {}
                    Ok(false) => {
                        all = false;
                        last = format!("{} not healthy yet", node.name);
                    }
                    Err(e) => {
                        all = false;
                        last = format!("{}: {e}", node.name);
                    }
                }
            }
            if all {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                let tails = self
                    .nodes
                    .iter()
                    .map(|n| format!("--- {} ---\n{}", n.name, n.process.log_tail(20)))
                    .collect::<Vec<_>>()
                    .join("\n");
                return Err(Error::Timeout {
                    what: format!("etcd cluster health ({last}); logs:\n{tails}"),
                    after: timeout,
                });
            }
            std::thread::sleep(process::READY_POLL);
        }
    }

    /// `etcd://h:p,h:p,h:p` listing every member.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoints())
    }

    /// `h:p,h:p,h:p`, as etcdctl's `--endpoints` takes it.
    pub fn endpoints(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.addr.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The client address of member `i` (0-based).
    pub fn addr(&self, i: usize) -> Option<SocketAddr> {
        self.nodes.get(i).map(|n| n.addr)
    }

    /// How many members.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the cluster has no members.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The raft timers.
    pub fn timers(&self) -> Timers {
        self.timers
    }

    fn node(&mut self, i: usize) -> Result<&mut Node> {
        let n = self.nodes.len();
        self.nodes
            .get_mut(i)
            .ok_or_else(|| Error::State(format!("no member {i} in a cluster of {n}")))
    }

    /// kill -9 of member `i` (its data dir and ports stay for [`restart`](Self::restart)).
    pub fn kill9(&mut self, i: usize) -> Result<()> {
        self.node(i)?.process.kill9()
    }

    /// Restarts member `i` on its data dir and waits until it is ours and listening (call
    /// [`wait_healthy`](Self::wait_healthy) for the cluster's health).
    pub fn restart(&mut self, i: usize) -> Result<()> {
        // etcd ignores the --initial-cluster* flags once its data dir holds a WAL, so the original
        // arguments rejoin the cluster as they are.
        self.node(i)?.process.restart()
    }

    /// SIGSTOP of member `i`.
    pub fn pause(&mut self, i: usize) -> Result<()> {
        self.node(i)?.process.pause()
    }

    /// SIGCONT of member `i`.
    pub fn resume(&mut self, i: usize) -> Result<()> {
        self.node(i)?.process.resume()
    }

    /// The pid of member `i`.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.nodes.get(i).map(|n| n.process.pid())
    }

    /// The temp dir of member `i`.
    pub fn dir(&self, i: usize) -> Option<PathBuf> {
        self.nodes.get(i).map(|n| n.process.dir().to_path_buf())
    }

    /// Runs `etcdctl` against all members.
    pub fn etcdctl(&self, args: &[&str]) -> Result<String> {
        etcdctl(&self.endpoints(), args)
    }
}
