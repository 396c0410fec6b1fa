//! ZooKeeper 3.8 servers for tests (Debian's `zookeeper` package): a standalone server ([`ZkServer`])
//! and a 3-member ensemble ([`ZkEnsemble`]), each member on reserved loopback ports (client, quorum,
//! election) with its data in its own temp dir.
//!
//! * The JVM is started directly (`zkServer.sh` would fork away from us), with a small heap, the
//!   serial GC and C1 only (infra.md §5), and `slf4j-simple` so the server logs to stderr (our log file).
//! * `zoo.cfg`: `tickTime=200` (short timers: the ensemble elects in about a second),
//!   `minSessionTimeout=400`, `maxSessionTimeout=60000` (without them ZooKeeper silently clamps session
//!   timeouts to 2..20 ticks), `admin.enableServer=false` (no Jetty on :8080), `4lw.commands.whitelist=*`,
//!   `forceSync=no` (no fsync per write: the tests never restart a server on its data, and an fsync on
//!   the shared machine's disk can take longer than the suite's timing bounds allow).
//! * **Readiness:** `ruok` answers `imok` and `srvr` reports `Mode: standalone|leader|follower` (`ruok`
//!   alone answers `imok` outside a quorum, infra.md §5), and the client port is listened on by our child.
//! * A missing `java` or jar fails with the install command; tests never skip.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::ports::{self, PortLease};
use crate::process::{self, Probe, ReadyProbe, ServerProcess, ServerSpec};
use crate::proxy::Proxy;

/// ZooKeeper's `syncLimit` on test servers, in ticks (1 s).
pub const SYNC_LIMIT: u32 = 5;
/// `syncLimit` of an ensemble started with quorum proxies, in ticks (3 s): the follower-cut tests need a
/// session timeout shorter than it (the follower keeps serving after the leader expired the session),
/// and 2 s sessions leave a loaded machine's renewals room that 600 ms ones did not.
pub const SYNC_LIMIT_QUORUM_PROXIED: u32 = 15;
/// The JVM.
pub const JAVA: &str = "java";
/// The server jar (package `zookeeper` / `libzookeeper-java`).
pub const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
/// The logging backend that makes the server log to stderr (package `libslf4j-java`).
pub const SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";
/// Shown when ZooKeeper or Java is missing.
pub const INSTALL_HINT: &str = "install it with `apt-get install -y zookeeper libzookeeper-java libslf4j-java default-jre-headless` (or run scripts/setup.sh)";
/// ZooKeeper's `tickTime` on test servers, milliseconds.
pub const TICK_MS: u32 = 200;
/// The shortest session timeout the test servers grant (`minSessionTimeout`).
pub const MIN_SESSION_TIMEOUT: Duration = Duration::from_millis(400);
/// Per-probe I/O timeout.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// How long an ensemble gets to elect a leader with every member serving.
const ENSEMBLE_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Fails with the install command when the JVM or the jars are missing.
pub fn check_installed() -> Result<()> {
    for jar in [ZOOKEEPER_JAR, SLF4J_SIMPLE_JAR] {
        if !Path::new(jar).exists() {
            return Err(Error::MissingBinary {
                program: jar.into(),
                hint: INSTALL_HINT.into(),
            });
        }
    }
    Ok(())
}

/// Sends a four-letter word to `addr` and returns the answer.
pub fn four_letter(addr: SocketAddr, word: &str) -> Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, PROBE_TIMEOUT)
        .map_err(|e| Error::io(format!("connecting to {addr}"), e))?;
    stream
        .set_read_timeout(Some(PROBE_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(PROBE_TIMEOUT)))
        .map_err(|e| Error::io("setting socket timeouts", e))?;
    stream
        .write_all(word.as_bytes())
        .map_err(|e| Error::io(format!("sending {word} to {addr}"), e))?;
    let mut reply = String::new();
    stream
        .read_to_string(&mut reply)
        .map_err(|e| Error::io(format!("reading the {word} answer of {addr}"), e))?;
    Ok(reply)
}

/// The `Mode:` a member reports (`standalone`, `leader`, `follower`), if it serves.
pub fn mode(addr: SocketAddr) -> Option<String> {
    let reply = four_letter(addr, "srvr").ok()?;
    reply
        .lines()
        .find_map(|l| l.strip_prefix("Mode: "))
        .map(|m| m.trim().to_string())
}

fn probe(addr: SocketAddr) -> Probe {
    match four_letter(addr, "ruok") {
        Ok(reply) if reply.trim() == "imok" => {}
        Ok(reply) => return Probe::NotYet(format!("ruok answered {reply:?}")),
        Err(e) => return Probe::NotYet(e.to_string()),
    }
    match mode(addr) {
        Some(_) => Probe::Ready,
        None => Probe::NotYet(format!("{addr} does not serve yet (srvr shows no Mode)")),
    }
}

/// One member's ports.
#[derive(Debug)]
struct Member {
    id: usize,
    client: PortLease,
    quorum: PortLease,
    election: PortLease,
    /// `syncLimit`, in ticks: how long a follower serves without hearing from the leader.
    sync_limit: u32,
    /// `tickTime`, ms; any other than [`TICK_MS`] runs with ZooKeeper's default session timeout bounds
    /// (2 to 20 ticks), as a server started with its defaults does.
    tick_ms: u32,
}

fn config(member: &Member, data_dir: &Path, servers: &str) -> String {
    let session_bounds = if member.tick_ms == TICK_MS {
        format!(
            "minSessionTimeout={}\nmaxSessionTimeout=60000\n",
            MIN_SESSION_TIMEOUT.as_millis()
        )
    } else {
        String::new()
    };
    format!(
        "tickTime={}\ninitLimit=10\nsyncLimit={}\ndataDir={}\nclientPort={}\nclientPortAddress=127.0.0.1\n\
         admin.enableServer=false\n4lw.commands.whitelist=*\n{session_bounds}\
         preAllocSize=1024\nforceSync=no\n{servers}",
        member.tick_ms,
        member.sync_limit,
        data_dir.display(),
        member.client.port(),
    )
}

fn spec(name: &str, cfg: &Path) -> ServerSpec {
    ServerSpec::new(name, JAVA)
        .install_hint(INSTALL_HINT)
        .args([
            "-Xms16m",
            "-Xmx128m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-Dzookeeper.admin.enableServer=false",
            "-cp",
            &format!("{ZOOKEEPER_JAR}:{SLF4J_SIMPLE_JAR}"),
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
        ])
        .arg(cfg)
        .env_remove("JAVA_TOOL_OPTIONS")
        .env_remove("JVMFLAGS")
}

/// Writes a member's dir (`zoo.cfg`, `data/myid`) and spawns it.
fn spawn_member(member: &Member, servers: &str, wait: bool) -> Result<ServerProcess> {
    check_installed()?;
    let dir = process::temp_dir(&format!("zookeeper{}", member.id))?;
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).map_err(|e| Error::io("creating the data dir", e))?;
    std::fs::write(data.join("myid"), format!("{}\n", member.id))
        .map_err(|e| Error::io("writing myid", e))?;
    let cfg = dir.path().join("zoo.cfg");
    std::fs::write(&cfg, config(member, &data, servers))
        .map_err(|e| Error::io("writing zoo.cfg", e))?;
    let addr = member.client.addr();
    let probe: ReadyProbe = if wait {
        Arc::new(move |_pid| probe(addr))
    } else {
        // An ensemble member serves only once a quorum is up: the ensemble waits for all together.
        Arc::new(|_pid| Probe::Ready)
    };
    ServerProcess::spawn(
        spec(&format!("zookeeper{}", member.id), &cfg),
        dir,
        Vec::new(),
        probe,
    )
}

/// A standalone ZooKeeper server on a free loopback port, killed on drop.
#[derive(Debug)]
pub struct ZkServer {
    member: Member,
    process: ServerProcess,
}

impl ZkServer {
    /// Starts a standalone server and waits until it serves.
    pub fn start() -> Result<ZkServer> {
        Self::start_with_tick(Duration::from_millis(u64::from(TICK_MS)))
    }

    /// Starts a standalone server with `tickTime` = `tick` (whole milliseconds) and waits until it
    /// serves. Any tick other than [`TICK_MS`] keeps ZooKeeper's default session timeout bounds, 2 to
    /// 20 ticks: `start_with_tick(2 s)` is a server started with ZooKeeper's defaults (sessions of
    /// 4 to 40 s).
    pub fn start_with_tick(tick: Duration) -> Result<ZkServer> {
        let member = Member {
            id: 1,
            client: ports::reserve()?,
            quorum: ports::reserve()?,
            election: ports::reserve()?,
            sync_limit: SYNC_LIMIT,
            tick_ms: u32::try_from(tick.as_millis()).unwrap_or(u32::MAX).max(1),
        };
        let process = spawn_member(&member, "", true)?;
        Ok(ZkServer { member, process })
    }

    /// [`start`](Self::start), panicking with the reason (and the install command) on failure.
    pub fn start_or_panic() -> ZkServer {
        match Self::start() {
            Ok(server) => server,
            Err(e) => panic!("could not start ZooKeeper: {e}"),
        }
    }

    /// `zk://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("zk://{}", self.addr())
    }

    /// The client address.
    pub fn addr(&self) -> SocketAddr {
        self.member.client.addr()
    }

    /// The server process (kill, pause, resume).
    pub fn process_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }

    /// The server's pid.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}

/// A 3-member (or n-member) ensemble on loopback, killed on drop.
#[derive(Debug)]
pub struct ZkEnsemble {
    members: Vec<Member>,
    processes: Vec<ServerProcess>,
    /// Member 1's proxies to the other members' quorum ports: (member index, proxy).
    quorum_proxies: Vec<(usize, Proxy)>,
}

impl ZkEnsemble {
    /// Starts `n` members and waits until each serves (a leader was elected).
    pub fn start(n: usize) -> Result<ZkEnsemble> {
        Self::start_inner(n, false)
    }

    /// Like [`start`](Self::start), but member 1 (index 0) reaches the other members' quorum ports
    /// through fault proxies of its own, so [`cut_quorum_link`](Self::cut_quorum_link) can cut member 1
    /// off from the leader while its clients stay connected to it (the other links and the election
    /// ports stay direct).
    pub fn start_with_quorum_proxies(n: usize) -> Result<ZkEnsemble> {
        Self::start_inner(n, true)
    }

    fn start_inner(n: usize, proxied: bool) -> Result<ZkEnsemble> {
        let mut members = Vec::with_capacity(n);
        for id in 1..=n {
            members.push(Member {
                id,
                client: ports::reserve()?,
                quorum: ports::reserve()?,
                election: ports::reserve()?,
                sync_limit: if proxied {
                    SYNC_LIMIT_QUORUM_PROXIED
                } else {
                    SYNC_LIMIT
                },
                tick_ms: TICK_MS,
            });
        }
        let line = |m: &Member, quorum: u16| {
            format!("server.{}=127.0.0.1:{quorum}:{}\n", m.id, m.election.port())
        };
        let servers: String = members.iter().map(|m| line(m, m.quorum.port())).collect();
        let mut quorum_proxies = Vec::new();
        let mut first_servers = servers.clone();
        if proxied {
            first_servers.clear();
            for (i, m) in members.iter().enumerate() {
                if i == 0 {
                    first_servers.push_str(&line(m, m.quorum.port()));
                    continue;
                }
                let proxy = Proxy::start(m.quorum.addr())?;
                first_servers.push_str(&line(m, proxy.port()));
                quorum_proxies.push((i, proxy));
            }
        }
        let mut processes = Vec::with_capacity(n);
        for (i, member) in members.iter().enumerate() {
            let servers = if i == 0 { &first_servers } else { &servers };
            processes.push(spawn_member(member, servers, false)?);
        }
        let ensemble = ZkEnsemble {
            members,
            processes,
            quorum_proxies,
        };
        ensemble.wait_serving(ENSEMBLE_READY_TIMEOUT)?;
        Ok(ensemble)
    }

    /// Drops member 1's traffic to member `to`'s quorum port (and back), as a partition between them
    /// would; only with [`start_with_quorum_proxies`](Self::start_with_quorum_proxies).
    pub fn cut_quorum_link(&self, to: usize) -> Result<()> {
        match self.quorum_proxies.iter().find(|(i, _)| *i == to) {
            Some((_, proxy)) => proxy.blackhole(),
            None => Err(Error::State(format!(
                "member 1 has no quorum proxy to member index {to} (start_with_quorum_proxies)"
            ))),
        }
    }

    /// [`start`](Self::start), panicking with the reason on failure.
    pub fn start_or_panic(n: usize) -> ZkEnsemble {
        match Self::start(n) {
            Ok(ensemble) => ensemble,
            Err(e) => panic!("could not start a ZooKeeper ensemble: {e}"),
        }
    }

    /// Waits until every running member reports a mode (leader or follower).
    pub fn wait_serving(&self, timeout: Duration) -> Result<()> {
        let started = Instant::now();
        loop {
            let pending: Vec<SocketAddr> = self
                .members
                .iter()
                .zip(&self.processes)
                .filter(|(_, p)| p.is_running())
                .map(|(m, _)| m.client.addr())
                .filter(|addr| mode(*addr).is_none())
                .collect();
            if pending.is_empty() {
                return Ok(());
            }
            if started.elapsed() > timeout {
                let logs: String = self.processes.iter().map(|p| p.log_tail(15)).collect();
                return Err(Error::io(
                    format!("ZooKeeper members {pending:?} not serving after {timeout:?}; logs:\n{logs}"),
                    std::io::Error::from(std::io::ErrorKind::TimedOut),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `zk://h1:p1,h2:p2,h3:p3`.
    pub fn url(&self) -> String {
        format!("zk://{}", self.connect_string())
    }

    /// `h1:p1,h2:p2,h3:p3`.
    pub fn connect_string(&self) -> String {
        self.members
            .iter()
            .map(|m| m.client.addr().to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The client address of member `i` (0-based).
    pub fn addr(&self, i: usize) -> Option<SocketAddr> {
        self.members.get(i).map(|m| m.client.addr())
    }

    /// The index of the current leader, if one reports itself.
    pub fn leader(&self) -> Option<usize> {
        self.members
            .iter()
            .position(|m| mode(m.client.addr()).as_deref() == Some("leader"))
    }

    /// Member `i`'s process.
    pub fn process_mut(&mut self, i: usize) -> Option<&mut ServerProcess> {
        self.processes.get_mut(i)
    }
}
