//! Redis master + replica + 3 Sentinels on loopback (infra.md §2), with short timers so a failover
//! takes ~2-3 s: `down-after-milliseconds` [`DOWN_AFTER_MS`], `failover-timeout`
//! [`FAILOVER_TIMEOUT_MS`], `repl-diskless-sync-delay 0`, and `SENTINEL DEBUG info-period 1000
//! publish-period 500 tilt-period 5000` applied at runtime (again after a sentinel restart).
//!
//! Start order (infra.md §2.3): master, PONG; replica, `master_link_status:up`; sentinels configured
//! with a writable config file each (Sentinel rewrites it); ready when every sentinel sees the master
//! healthy, the 2 other sentinels and the replica (`role-reported slave`, `master-link-status ok`), and
//! `SENTINEL CKQUORUM` says OK.
//!
//! # Losing a write on failover (infra.md §2.4)
//!
//! The replica replicates **directly** from the master, not through a [`crate::proxy::Proxy`]:
//! Sentinel compares the master address a replica reports with its own view and, after
//! `failover-timeout`, re-points a replica that replicates from anywhere else (`+fix-slave-config`), so
//! a proxy in the replication link would be bypassed ~2 s after start. The deterministic recipes are:
//!
//! * [`SentinelGroup::pause_replica_writes`]: `CLIENT PAUSE <ms> WRITE` on the replica stops it
//!   applying the replication stream (lost 5 of 5 runs in §2.4): write on the master, `WAIT 1 100` → 0,
//!   kill -9 the master, [`SentinelGroup::wait_failover`], the write is gone.
//! * [`SentinelGroup::detach_replica`] / [`SentinelGroup::reattach_replica`]: `REPLICAOF` a dead port
//!   (keeps the replica's data, 3 of 3 runs); reattach well within `failover-timeout` after the master
//!   is killed.

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::ports::{self, PortLease};
use crate::process::{self, ServerProcess, ServerSpec, READY_POLL, READY_TIMEOUT};
use crate::redis::{self, RedisServer, RespConn, RespValue};

/// The sentinel binary.
pub const REDIS_SENTINEL: &str = "redis-sentinel";
/// Shown when it is missing.
pub const SENTINEL_INSTALL_HINT: &str =
    "install it with `apt-get install -y redis-sentinel` (or run scripts/setup.sh)";
/// The monitored master's name.
pub const MASTER_NAME: &str = "mymaster";
/// `sentinel down-after-milliseconds`.
pub const DOWN_AFTER_MS: u64 = 1000;
/// `sentinel failover-timeout` (a new failover of the same master is refused for twice this).
pub const FAILOVER_TIMEOUT_MS: u64 = 2000;
/// Number of sentinels; the quorum is 2.
pub const SENTINELS: usize = 3;
/// Per-command timeout of the group's own queries.
const QUERY_TIMEOUT: Duration = Duration::from_millis(1000);
/// Log lines quoted in errors.
const LOG_LINES: usize = 30;

/// One `redis-sentinel` process.
#[derive(Debug)]
pub struct Sentinel {
    process: ServerProcess,
    addr: SocketAddr,
}

impl Sentinel {
    fn start(master: SocketAddr) -> Result<Sentinel> {
        let lease = ports::reserve()?;
        let addr = lease.addr();
        let dir = process::temp_dir("sentinel")?;
        let conf = dir.path().join("sentinel.conf");
        let body = format!(
            "port {port}\nbind 127.0.0.1\ndaemonize no\nlogfile \"\"\ndir \"{dir}\"\n\
             sentinel resolve-hostnames no\n\
             sentinel monitor {MASTER_NAME} {ip} {mport} 2\n\
             sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n\
             sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n\
             sentinel parallel-syncs {MASTER_NAME} 1\n",
            port = addr.port(),
            dir = dir.path().display(),
            ip = master.ip(),
            mport = master.port(),
        );
        fs::write(&conf, body).map_err(|e| Error::io(format!("writing {}", conf.display()), e))?;
        let spec = ServerSpec::new("sentinel", REDIS_SENTINEL)
            .install_hint(SENTINEL_INSTALL_HINT)
            .arg(&conf);
        let process = ServerProcess::spawn(spec, dir, vec![lease], redis::ready_probe(addr))?;
        let s = Sentinel { process, addr };
        s.apply_debug_timers()?;
        Ok(s)
    }

    /// `SENTINEL DEBUG` timers are runtime only: applied after every (re)start.
    fn apply_debug_timers(&self) -> Result<()> {
        let reply = self.command(&[
            "SENTINEL",
            "DEBUG",
            "info-period",
            "1000",
            "publish-period",
            "500",
            "tilt-period",
            "5000",
        ])?;
        if let RespValue::Error(e) = reply {
            tracing::warn!(sentinel = %self.addr, error = %e, "SENTINEL DEBUG refused; default timers");
        }
        Ok(())
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The pid (changes on restart).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The generic process handle.
    pub fn process(&self) -> &ServerProcess {
        &self.process
    }

    /// kill -9.
    pub fn kill9(&mut self) -> Result<()> {
        self.process.kill9()
    }

    /// Starts again with the same (rewritten) config file and re-applies the debug timers.
    pub fn restart(&mut self) -> Result<()> {
        self.process.restart()?;
        self.apply_debug_timers()
    }

    /// SIGSTOP (beware TILT mode on resume: its timer jumped).
    pub fn pause(&mut self) -> Result<()> {
        self.process.pause()
    }

    /// SIGCONT.
    pub fn resume(&mut self) -> Result<()> {
        self.process.resume()
    }

    /// The last `n` log lines.
    pub fn log_tail(&self, n: usize) -> String {
        self.process.log_tail(n)
    }

    /// Runs one command on a fresh connection (1 s timeout).
    pub fn command(&self, args: &[&str]) -> Result<RespValue> {
        RespConn::connect(self.addr, QUERY_TIMEOUT)?.command(args)
    }

    /// The master address this sentinel names (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
    pub fn master_addr(&self) -> Result<SocketAddr> {
        let reply = self.command(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME])?;
        match &reply {
            RespValue::Array(items) if items.len() == 2 => {
                let ip = items[0].as_str().and_then(|s| s.parse::<IpAddr>().ok());
                let port = items[1].as_str().and_then(|s| s.parse::<u16>().ok());
                match (ip, port) {
                    (Some(ip), Some(port)) => Ok(SocketAddr::new(ip, port)),
                    _ => Err(Error::Protocol(format!(
                        "GET-MASTER-ADDR-BY-NAME answered {reply}"
                    ))),
                }
            }
            _ => Err(Error::Protocol(format!(
                "GET-MASTER-ADDR-BY-NAME answered {reply}"
            ))),
        }
    }
}

/// A master, a replica and 3 sentinels, all on loopback. Dropping it kills them all.
pub struct SentinelGroup {
    // Declared first so they die first: no sentinel acts on a half-dropped group.
    sentinels: Vec<Sentinel>,
    /// `[initial master, initial replica]`.
    servers: [RedisServer; 2],
    /// Index into `servers` of the current master.
    master: usize,
    /// Held while the replica is detached: the dead port it replicates from.
    detached: Option<PortLease>,
}

impl fmt::Debug for SentinelGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelGroup")
            .field("master", &self.master().addr())
            .field("replica", &self.replica().addr())
            .field("sentinels", &self.sentinel_addrs())
            .finish_non_exhaustive()
    }
}

impl SentinelGroup {
    /// Starts master, replica and sentinels and waits until the sentinels have converged (see the
    /// module docs). ~1-2 s on an idle machine.
    pub fn start() -> Result<SentinelGroup> {
        let started = Instant::now();
        let master = RedisServer::builder()
            .args(["--repl-diskless-sync-delay", "0"])
            .start()?;
        let replica = RedisServer::builder()
            .args([
                "--repl-diskless-sync-delay",
                "0",
                "--replicaof",
                "127.0.0.1",
            ])
            .arg(master.port().to_string())
            .start()?;
        wait_link_up(&replica, READY_TIMEOUT)?;
        let mut sentinels = Vec::with_capacity(SENTINELS);
        for _ in 0..SENTINELS {
            sentinels.push(Sentinel::start(master.addr())?);
        }
        let group = SentinelGroup {
            sentinels,
            servers: [master, replica],
            master: 0,
            detached: None,
        };
        group.wait_converged(READY_TIMEOUT)?;
        tracing::debug!(elapsed = ?started.elapsed(), group = ?group, "sentinel group ready");
        Ok(group)
    }

    /// [`start`](Self::start), panicking with the error (which carries log tails). For tests.
    pub fn start_or_panic() -> SentinelGroup {
        match Self::start() {
            Ok(g) => g,
            Err(e) => panic!("starting the sentinel group failed: {e}"),
        }
    }

    /// `"mymaster"`.
    pub fn master_name(&self) -> &'static str {
        MASTER_NAME
    }

    /// The server that is master: the initial master until [`wait_failover`](Self::wait_failover)
    /// succeeds, then the promoted replica.
    pub fn master(&self) -> &RedisServer {
        &self.servers[self.master]
    }

    /// The master, mutably (kill9, restart, pause, resume).
    pub fn master_mut(&mut self) -> &mut RedisServer {
        &mut self.servers[self.master]
    }

    /// The other server (the replica, or after a failover the former master).
    pub fn replica(&self) -> &RedisServer {
        &self.servers[1 - self.master]
    }

    /// The replica, mutably.
    pub fn replica_mut(&mut self) -> &mut RedisServer {
        &mut self.servers[1 - self.master]
    }

    /// The sentinels.
    pub fn sentinels(&self) -> &[Sentinel] {
        &self.sentinels
    }

    /// One sentinel, mutably (kill9, restart, pause).
    pub fn sentinel_mut(&mut self, i: usize) -> Option<&mut Sentinel> {
        self.sentinels.get_mut(i)
    }

    /// The sentinels' addresses.
    pub fn sentinel_addrs(&self) -> Vec<SocketAddr> {
        self.sentinels.iter().map(Sentinel::addr).collect()
    }

    /// `redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/mymaster`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.sentinels.iter().map(|s| s.addr.to_string()).collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", hosts.join(","))
    }

    /// Waits until every running sentinel names the current master, sees it healthy, sees the other
    /// sentinels and the replica as a linked replica, and `CKQUORUM` is OK. Call it before a manual
    /// `SENTINEL FAILOVER` (infra.md §2.3's flip-flop pitfall).
    pub fn wait_converged(&self, timeout: Duration) -> Result<()> {
        let master = self.master().addr();
        let replica = self.replica().addr();
        self.poll("sentinels to converge", timeout, || {
            for s in self.sentinels.iter().filter(|s| s.process.is_running()) {
                check_converged(s, master, replica)
                    .map_err(|why| format!("sentinel {}: {why}", s.addr))?;
            }
            Ok(())
        })
    }

    /// After the master was killed (or partitioned, or `SENTINEL FAILOVER`): waits until every running
    /// sentinel names the replica as master and the replica reports `role:master`, then swaps the
    /// roles, so [`master`](Self::master) is the promoted server.
    pub fn wait_failover(&mut self, timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let target = self.replica().addr();
        {
            let replica = self.replica();
            self.poll("sentinel failover", timeout, || {
                for s in self.sentinels.iter().filter(|s| s.process.is_running()) {
                    let named = s.master_addr().map_err(|e| e.to_string())?;
                    if named != target {
                        return Err(format!("sentinel {} still names {named}", s.addr));
                    }
                }
                let role = info_replication(replica).map_err(|e| e.to_string())?;
                match role.get("role").map(String::as_str) {
                    Some("master") => Ok(()),
                    other => Err(format!("{target} reports role {other:?}")),
                }
            })?;
        }
        self.master = 1 - self.master;
        tracing::debug!(new_master = %target, elapsed = ?started.elapsed(), "failover done");
        Ok(())
    }

    /// What every running sentinel names as master right now.
    pub fn sentinel_master_addrs(&self) -> Result<Vec<SocketAddr>> {
        self.sentinels
            .iter()
            .filter(|s| s.process.is_running())
            .map(Sentinel::master_addr)
            .collect()
    }

    /// Waits until the replica has applied everything the master has written so far (replication
    /// offsets equal).
    pub fn wait_replicated(&self, timeout: Duration) -> Result<()> {
        self.poll("the replica to catch up", timeout, || {
            let m = info_replication(self.master()).map_err(|e| e.to_string())?;
            let r = info_replication(self.replica()).map_err(|e| e.to_string())?;
            let mo = m.get("master_repl_offset").cloned().unwrap_or_default();
            let ro = r.get("slave_repl_offset").cloned().unwrap_or_default();
            if !mo.is_empty() && mo == ro {
                Ok(())
            } else {
                Err(format!("master offset {mo:?}, replica offset {ro:?}"))
            }
        })
    }

    /// `CLIENT PAUSE <ms> WRITE` on the replica: for `duration` it stops applying the replication
    /// stream, so a write on the master is not on the replica (`WAIT 1 100` on the writing connection
    /// returns 0). Kill the master within `duration` and the write is lost on failover (infra.md §2.4).
    pub fn pause_replica_writes(&self, duration: Duration) -> Result<()> {
        let ms = duration.as_millis().max(1).to_string();
        match self.replica().command(&["CLIENT", "PAUSE", &ms, "WRITE"])? {
            RespValue::Error(e) => Err(Error::Protocol(format!("CLIENT PAUSE WRITE: {e}"))),
            _ => Ok(()),
        }
    }

    /// `REPLICAOF 127.0.0.1 <a reserved port nobody listens on>` on the replica: it keeps its data and
    /// stops replicating. Undo with [`reattach_replica`](Self::reattach_replica) within
    /// [`FAILOVER_TIMEOUT_MS`], or Sentinel re-points it itself (`+fix-slave-config`).
    pub fn detach_replica(&mut self) -> Result<()> {
        let lease = match self.detached.take() {
            Some(l) => l,
            None => ports::reserve()?,
        };
        let port = lease.port().to_string();
        self.detached = Some(lease);
        match self.replica().command(&["REPLICAOF", "127.0.0.1", &port])? {
            RespValue::Error(e) => Err(Error::Protocol(format!("REPLICAOF: {e}"))),
            _ => Ok(()),
        }
    }

    /// Points the replica back at the current master's address (dead or alive).
    pub fn reattach_replica(&mut self) -> Result<()> {
        let port = self.master().port().to_string();
        let reply = self.replica().command(&["REPLICAOF", "127.0.0.1", &port])?;
        self.detached = None;
        match reply {
            RespValue::Error(e) => Err(Error::Protocol(format!("REPLICAOF: {e}"))),
            _ => Ok(()),
        }
    }

    /// The last `n` log lines of every process, labelled, for error messages.
    pub fn log_tails(&self, n: usize) -> String {
        let mut out = String::new();
        for (label, server) in [("master", self.master()), ("replica", self.replica())] {
            out.push_str(&format!(
                "--- {label} {} ---\n{}\n",
                server.addr(),
                server.log_tail(n)
            ));
        }
        for s in &self.sentinels {
            out.push_str(&format!("--- sentinel {} ---\n{}\n", s.addr, s.log_tail(n)));
        }
        out
    }

    fn poll(
        &self,
        what: &str,
        timeout: Duration,
        check: impl FnMut() -> std::result::Result<(), String>,
    ) -> Result<()> {
        poll_until(timeout, check).map_err(|last| Error::Timeout {
            what: format!(
                "waiting for {what} (last: {last}); logs:\n{}",
                self.log_tails(LOG_LINES)
            ),
            after: timeout,
        })
    }
}

/// Polls `check` every [`READY_POLL`] until it returns `Ok` or `timeout` passes; `Err(last reason)`.
pub(crate) fn poll_until(
    timeout: Duration,
    mut check: impl FnMut() -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let why = match check() {
            Ok(()) => return Ok(()),
            Err(why) => why,
        };
        if Instant::now() >= deadline {
            return Err(why);
        }
        std::thread::sleep(READY_POLL);
    }
}

/// `field:value` lines of an INFO reply.
pub(crate) fn info_map(info: &str) -> HashMap<String, String> {
    info.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// `INFO replication` of a server, as a map.
pub(crate) fn info_replication(server: &RedisServer) -> Result<HashMap<String, String>> {
    let reply = server.command_timeout(&["INFO", "replication"], QUERY_TIMEOUT)?;
    reply
        .as_str()
        .map(info_map)
        .ok_or_else(|| Error::Protocol(format!("INFO replication answered {reply}")))
}

/// A flat `[field, value, ...]` array (SENTINEL MASTER, SENTINEL REPLICAS entries) as a map.
fn pairs(v: &RespValue) -> HashMap<String, String> {
    let mut map = HashMap::new();
    if let RespValue::Array(items) = v {
        for kv in items.chunks(2) {
            if let [k, v] = kv {
                if let (Some(k), Some(v)) = (k.as_str(), v.as_str()) {
                    map.insert(k.to_owned(), v.to_owned());
                }
            }
        }
    }
    map
}

fn check_converged(
    s: &Sentinel,
    master: SocketAddr,
    replica: SocketAddr,
) -> std::result::Result<(), String> {
    let err = |e: Error| e.to_string();
    let m = pairs(
        &s.command(&["SENTINEL", "MASTER", MASTER_NAME])
            .map_err(err)?,
    );
    let field = |k: &str| m.get(k).map(String::as_str).unwrap_or("?");
    if field("ip") != master.ip().to_string() || field("port") != master.port().to_string() {
        return Err(format!(
            "names master {}:{}, not {master}",
            field("ip"),
            field("port")
        ));
    }
    if field("flags") != "master" {
        return Err(format!("master flags {}", field("flags")));
    }
    let others = (SENTINELS - 1).to_string();
    if field("num-other-sentinels") != others || field("num-slaves") != "1" {
        return Err(format!(
            "sees {} other sentinels and {} replicas",
            field("num-other-sentinels"),
            field("num-slaves")
        ));
    }
    let replicas = s
        .command(&["SENTINEL", "REPLICAS", MASTER_NAME])
        .map_err(err)?;
    let RespValue::Array(entries) = &replicas else {
        return Err(format!("SENTINEL REPLICAS answered {replicas}"));
    };
    let linked = entries.iter().map(pairs).any(|r| {
        r.get("port").map(String::as_str) == Some(&replica.port().to_string())
            && r.get("flags").map(String::as_str) == Some("slave")
            && r.get("role-reported").map(String::as_str) == Some("slave")
            && r.get("master-link-status").map(String::as_str) == Some("ok")
    });
    if !linked {
        return Err(format!("replica {replica} not seen as a linked replica"));
    }
    match s
        .command(&["SENTINEL", "CKQUORUM", MASTER_NAME])
        .map_err(err)?
    {
        RespValue::Simple(ok) if ok.starts_with("OK") => Ok(()),
        other => Err(format!("CKQUORUM: {other}")),
    }
}

/// Waits until `replica` reports `master_link_status:up`.
fn wait_link_up(replica: &RedisServer, timeout: Duration) -> Result<()> {
    let started = Instant::now();
    poll_until(timeout, || {
        let info = info_replication(replica).map_err(|e| e.to_string())?;
        match info.get("master_link_status").map(String::as_str) {
            Some("up") => Ok(()),
            other => Err(format!("master_link_status {other:?}")),
        }
    })
    .map_err(|last| Error::NotReady {
        name: "redis replica".to_owned(),
        pid: replica.pid(),
        waited: started.elapsed(),
        last,
        dir: replica.dir().to_path_buf(),
        log_tail: replica.log_tail(LOG_LINES),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_flat_pairs() {
        let v = RespValue::Array(vec![
            RespValue::Bulk(b"name".to_vec()),
            RespValue::Bulk(b"mymaster".to_vec()),
            RespValue::Bulk(b"num-slaves".to_vec()),
            RespValue::Bulk(b"1".to_vec()),
        ]);
        let m = pairs(&v);
        assert_eq!(m.get("name").map(String::as_str), Some("mymaster"));
        assert_eq!(m.get("num-slaves").map(String::as_str), Some("1"));
    }

    #[test]
    fn parses_info() {
        let m = info_map("# Replication\r\nrole:slave\r\nmaster_link_status:up\r\n");
        assert_eq!(m.get("role").map(String::as_str), Some("slave"));
        assert_eq!(m.get("master_link_status").map(String::as_str), Some("up"));
    }
}
