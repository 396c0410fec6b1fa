//! CPU time per cycle: the figure of `distlock bench` that does not swing with the machine's load
//! (issue 9).
//!
//! On a shared machine the wall-clock ratios move by ~50 % from one run to the next: a cycle waits
//! for a core as often as for the server. The CPU time a cycle costs, in the bench process and in the
//! server, is the work itself and stays put; it is the primary figure of the report.
//!
//! # Interface (for every workload, including ones added later)
//!
//! * [`ServerCpu::resolve`], once per run, from the [`Engine`]: where the server's CPU time is read
//!   (or why it is not). Cheap to share by reference; [`ServerCpu::source`] names it for the report.
//! * [`CpuMeter::start`] right before the common start of a measurement (after every task has
//!   warmed up), [`CpuMeter::stop`] right after the last task finished: a [`CpuSpent`], the client's
//!   and the server's CPU time over that interval. `start` reads the server first and the client
//!   last, `stop` the client first, so the bench's own reading is outside the client's figure.
//! * [`CpuSpent::per`]`(n)`: the report's [`CpuFigures`], in µs per cycle (per acquisition, per
//!   call, per renewal tick: whatever `n` counts).
//!
//! `harness::run_tasks` does this for every measurement (so every `run_cycles` and
//! `run_contended` result carries a `cpu: CpuSpent`); a workload with its own loop (a `hold`
//! workload's renewal ticks) calls `start`/`stop` around its measured interval and divides by its own
//! count.
//!
//! # Sources
//!
//! * Client: `clock_gettime(CLOCK_PROCESS_CPUTIME_ID)` of the bench process, every thread, user +
//!   system, in ns: the same accounting as `getrusage(RUSAGE_SELF)`'s `ru_utime + ru_stime` (both
//!   are the kernel's run time of the thread group), without `unsafe`. The user/system split comes
//!   from `/proc/self/stat` (clock ticks, 10 ms). It includes everything the process does in the
//!   interval: distlock or the baseline client, the runtime, the I/O driver, the watchdog.
//! * Server, per engine: Redis `INFO cpu` (`used_cpu_user + used_cpu_sys`, the server's
//!   `getrusage`, µs), on a connection of its own; etcd's `process_cpu_seconds_total` from
//!   `GET /metrics` on each member's client URL when it is plain http (10 ms ticks; the reading
//!   includes the encoding of one metrics page, ~1 ms); any other server on this machine (ZooKeeper,
//!   PostgreSQL, MariaDB, and the fallback for Redis and etcd): the kernel's accounting of the process
//!   listening on the server's loopback port (`/proc/net/tcp{,6}` → socket inode → `/proc/*/fd`),
//!   `utime + stime + cutime + cstime` of it and its live descendants (PostgreSQL forks a backend
//!   per connection) from `/proc/<pid>/stat`, in 10 ms ticks. Redlock and several etcd members: the
//!   sum over the nodes. `memory://` and `file://`: none, in-process (the file backend's kernel work,
//!   `fdatasync` included, is the bench process's own system time).

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::engines::Engine;
use crate::stats::round2;

/// How long one server reading may take before the measurement goes without server CPU.
const READ_LIMIT: Duration = Duration::from_secs(3);
/// The largest metrics page read from etcd.
const METRICS_LIMIT: u64 = 16 << 20;

/// What the client figure is.
pub const CLIENT_SOURCE: &str =
    "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) of the bench process (= getrusage user + sys)";

/// Where the server's CPU time is read, resolved once per run.
#[derive(Debug, Clone)]
pub struct ServerCpu {
    reader: Reader,
    /// No server: the client's figure is the whole cost.
    in_process: bool,
    source: String,
}

#[derive(Debug, Clone)]
enum Reader {
    None,
    RedisInfo(redis::aio::MultiplexedConnection),
    EtcdMetrics { addr: String },
    Proc { pid: u32 },
    Sum(Vec<Reader>),
}

impl ServerCpu {
    fn none(reason: impl Into<String>, in_process: bool) -> Self {
        Self {
            reader: Reader::None,
            in_process,
            source: format!("none: {}", reason.into()),
        }
    }

    /// A source that reads nothing: "none: {reason}".
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::none(reason, false)
    }

    /// Finds where the engine's CPU time can be read; never fails (the source then says why not).
    pub async fn resolve(engine: &Engine) -> Self {
        match engine {
            Engine::Memory => Self::none("in-process", true),
            Engine::File { .. } => Self::none("in-process (kernel work is the bench's own)", true),
            Engine::Unmeasured { reason } => Self::unavailable(reason.clone()),
            Engine::Redis(server) => {
                let (host, port) = server.host_port();
                let info = match server.connect().await {
                    Ok(conn) => Reader::RedisInfo(conn),
                    Err(e) => return Self::unavailable(format!("cannot connect for INFO: {e}")),
                };
                Self::first_readable(vec![(info, "redis INFO cpu")], &host, port).await
            }
            Engine::Redlock(config) => {
                let mut parts = Vec::new();
                for node in &config.nodes {
                    let uri = crate::redlock::rslock_uri(config, node);
                    let info = match redis_connect(&uri).await {
                        Some(conn) => vec![(Reader::RedisInfo(conn), "redis INFO cpu")],
                        None => Vec::new(),
                    };
                    parts.push(Self::first_readable(info, node.host(), node.port()).await);
                }
                Self::sum(parts, "redlock nodes")
            }
            Engine::Etcd { config } => {
                let mut parts = Vec::new();
                for endpoint in &config.endpoints {
                    let Ok(endpoint) = distlock_core::url::Endpoint::parse(endpoint, 2379) else {
                        return Self::unavailable(format!("unreadable endpoint {endpoint}"));
                    };
                    let (host, port) = (endpoint.host(), endpoint.port());
                    let mut tries = Vec::new();
                    if !config.connection.tls {
                        let addr = endpoint.to_string();
                        tries.push((
                            Reader::EtcdMetrics { addr },
                            "etcd process_cpu_seconds_total",
                        ));
                    }
                    parts.push(Self::first_readable(tries, host, port).await);
                }
                Self::sum(parts, "etcd members")
            }
            Engine::ZooKeeper { config } => {
                let mut parts = Vec::new();
                for endpoint in &config.endpoints {
                    let Ok(endpoint) = distlock_core::url::Endpoint::parse(endpoint, 2181) else {
                        return Self::unavailable(format!("unreadable endpoint {endpoint}"));
                    };
                    parts
                        .push(Self::first_readable(vec![], endpoint.host(), endpoint.port()).await);
                }
                Self::sum(parts, "zookeeper servers")
            }
            Engine::Postgres { url, .. } => match crate::postgres::host_port(url) {
                Some((host, port)) => Self::first_readable(vec![], &host, port).await,
                None => Self::unavailable("not one TCP host in the URL"),
            },
            Engine::Mysql { url, .. } => match crate::mysql::host_port(url) {
                Some((host, port)) => Self::first_readable(vec![], &host, port).await,
                None => Self::unavailable("not one TCP host in the URL"),
            },
        }
    }

    /// The first of `tries` that answers, else the local process listening on `host:port`.
    async fn first_readable(tries: Vec<(Reader, &str)>, host: &str, port: u16) -> Self {
        let mut failures = Vec::new();
        for (reader, name) in tries {
            match reader.read().await {
                Ok(_) => {
                    return Self {
                        reader,
                        in_process: false,
                        source: name.to_string(),
                    }
                }
                Err(e) => failures.push(format!("{name}: {e}")),
            }
        }
        let fallback = match local_server_pid(host, port).await {
            Ok(pid) => {
                let reader = Reader::Proc { pid };
                match reader.read().await {
                    Ok(_) => {
                        let mut source = format!("/proc/{pid}/stat of the local server");
                        if !failures.is_empty() {
                            source.push_str(&format!(" ({} failed)", failures.join("; ")));
                        }
                        return Self {
                            reader,
                            in_process: false,
                            source,
                        };
                    }
                    Err(e) => format!("/proc/{pid}/stat: {e}"),
                }
            }
            Err(e) => e,
        };
        failures.push(fallback);
        Self::unavailable(failures.join("; "))
    }

    /// All the parts, summed; none when one of them has no source.
    fn sum(parts: Vec<ServerCpu>, what: &str) -> Self {
        if parts.len() == 1 {
            return parts
                .into_iter()
                .next()
                .unwrap_or_else(|| Self::unavailable(""));
        }
        if let Some(missing) = parts.iter().find(|p| matches!(p.reader, Reader::None)) {
            return Self::unavailable(format!("one of the {what}: {}", missing.source));
        }
        let mut sources: Vec<&str> = parts.iter().map(|p| p.source.as_str()).collect();
        sources.dedup();
        let source = format!(
            "{}, summed over {} {what}",
            sources.join(" / "),
            parts.len()
        );
        Self {
            reader: Reader::Sum(parts.into_iter().map(|p| p.reader).collect()),
            in_process: false,
            source,
        }
    }

    /// What the server figure is ("redis INFO cpu", "none: in-process", …).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The server's CPU time so far; `None` when there is no source.
    async fn read(&self) -> Option<Result<Duration, String>> {
        match self.reader {
            Reader::None => None,
            ref reader => Some(
                tokio::time::timeout(READ_LIMIT, reader.read())
                    .await
                    .unwrap_or_else(|_| Err("no answer in time".to_string())),
            ),
        }
    }
}

async fn redis_connect(uri: &str) -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(uri).ok()?;
    tokio::time::timeout(READ_LIMIT, client.get_multiplexed_async_connection())
        .await
        .ok()?
        .ok()
}

impl Reader {
    fn read(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Duration, String>> + Send + '_>>
    {
        Box::pin(async move {
            match self {
                Reader::None => Err("no source".to_string()),
                Reader::RedisInfo(conn) => redis_info_cpu(conn.clone()).await,
                Reader::EtcdMetrics { addr } => etcd_metrics_cpu(addr).await,
                Reader::Proc { pid } => {
                    let pid = *pid;
                    tokio::task::spawn_blocking(move || proc_tree_cpu(pid))
                        .await
                        .map_err(|e| e.to_string())?
                }
                Reader::Sum(parts) => {
                    let mut total = Duration::ZERO;
                    for part in parts {
                        total += part.read().await?;
                    }
                    Ok(total)
                }
            }
        })
    }
}

async fn redis_info_cpu(mut conn: redis::aio::MultiplexedConnection) -> Result<Duration, String> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    parse_redis_info_cpu(&info)
}

/// `used_cpu_sys + used_cpu_user` of an `INFO cpu` reply (seconds with 6 decimals).
fn parse_redis_info_cpu(info: &str) -> Result<Duration, String> {
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("no {name} in INFO cpu"))
    };
    let seconds = field("used_cpu_sys")? + field("used_cpu_user")?;
    Ok(Duration::from_micros((seconds * 1e6).round() as u64))
}

/// `process_cpu_seconds_total` from `GET /metrics` (HTTP/1.0, so the body is neither chunked nor
/// kept alive: it ends when the server closes).
async fn etcd_metrics_cpu(addr: &str) -> Result<Duration, String> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\nAccept: text/plain\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut page = Vec::new();
    (&mut stream)
        .take(METRICS_LIMIT)
        .read_to_end(&mut page)
        .await
        .map_err(|e| e.to_string())?;
    let page = String::from_utf8_lossy(&page);
    if !page.starts_with("HTTP/1.") || !page.lines().next().is_some_and(|l| l.contains(" 200")) {
        return Err(format!(
            "GET /metrics: {}",
            page.lines().next().unwrap_or("no answer")
        ));
    }
    parse_metric(&page, "process_cpu_seconds_total")
        .map(Duration::from_secs_f64)
        .ok_or_else(|| "no process_cpu_seconds_total in /metrics".to_string())
}

/// A metric without labels, from a Prometheus text page.
fn parse_metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
}

// --- the kernel's accounting of a local server ------------------------------------------------------

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The process listening on `port` when `host` is this machine's loopback.
async fn local_server_pid(host: &str, port: u16) -> Result<u32, String> {
    if !is_loopback(host) {
        return Err(format!("{host} is not a loopback address"));
    }
    tokio::task::spawn_blocking(move || listening_pid(port))
        .await
        .map_err(|e| e.to_string())?
}

fn listening_pid(port: u16) -> Result<u32, String> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(table) {
            inodes.extend(listening_inodes(&text, port));
        }
    }
    if inodes.is_empty() {
        return Err(format!("no listener on port {port} in /proc/net/tcp"));
    }
    let sockets: Vec<String> = inodes.iter().map(|i| format!("socket:[{i}]")).collect();
    let mut holders = Vec::new();
    for pid in proc_pids() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue; // another user's process
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|link| sockets.iter().any(|s| link.as_os_str() == s.as_str()))
        });
        if holds {
            holders.push(pid);
        }
    }
    // Forked children may inherit the listening socket: the server is the holder whose parent is not
    // one.
    let parents: HashMap<u32, u32> = holders
        .iter()
        .filter_map(|&pid| Some((pid, read_stat(pid).ok()?.ppid)))
        .collect();
    holders
        .iter()
        .copied()
        .filter(|pid| parents.get(pid).is_none_or(|ppid| !holders.contains(ppid)))
        .min()
        .ok_or_else(|| format!("no process of this user holds the listener on port {port}"))
}

/// The inodes of the LISTEN rows (state 0A) for `port` of a `/proc/net/tcp{,6}` table.
fn listening_inodes(table: &str, port: u16) -> Vec<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields.get(1)?.rsplit_once(':')?.1;
            let listening = *fields.get(3)? == "0A";
            let matches = u16::from_str_radix(local_port, 16).ok()? == port;
            (listening && matches).then(|| fields.get(9)?.parse().ok())?
        })
        .collect()
}

fn proc_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[derive(Debug, Clone, Copy)]
struct Stat {
    ppid: u32,
    /// utime + stime + cutime + cstime, in clock ticks.
    ticks: u64,
    /// utime and stime alone, in clock ticks.
    user: u64,
    system: u64,
    /// cutime + cstime: of its children reaped so far, in clock ticks.
    reaped: u64,
}

fn read_stat(pid: u32) -> Result<Stat, String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| e.to_string())?;
    parse_stat(&text).ok_or_else(|| format!("unreadable /proc/{pid}/stat"))
}

/// Fields of `/proc/<pid>/stat` (proc(5)): after the command in parentheses, field 3 (state) comes
/// first; ppid is field 4, utime..cstime fields 14..17.
fn parse_stat(text: &str) -> Option<Stat> {
    let after = text.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let (user, system) = (field(14)?, field(15)?);
    Some(Stat {
        ppid: u32::try_from(field(4)?).ok()?,
        ticks: user + system + field(16)? + field(17)?,
        user,
        system,
        reaped: field(16)? + field(17)?,
    })
}

fn ticks(n: u64) -> Duration {
    let hz = rustix::param::clock_ticks_per_second().max(1);
    Duration::from_nanos(n.saturating_mul(1_000_000_000) / hz)
}

/// CPU time of `root` and its live descendants, each with its reaped children's: a child that exits
/// moves from the live sum to its parent's `cutime`, so the total only grows. A child reaped while
/// the descendants are read would be counted twice or not at all (the scan is not one snapshot: a
/// server's connection that closed as a measurement began read 0 µs of server CPU for a whole
/// measurement), so the sample is taken again until the root's reaped-children time held still
/// across the scan.
fn proc_tree_cpu(root: u32) -> Result<Duration, String> {
    let mut total = proc_tree_scan(root)?;
    for _ in 0..10 {
        let (before, scanned) = total;
        let after = read_stat(root)
            .map_err(|e| format!("the server (pid {root}) is gone: {e}"))?
            .reaped;
        if after == before.reaped {
            return Ok(ticks(scanned));
        }
        total = proc_tree_scan(root)?;
    }
    Ok(ticks(total.1))
}

/// The root's stat as read before the scan, and the sum of [`proc_tree_cpu`] in clock ticks.
fn proc_tree_scan(root: u32) -> Result<(Stat, u64), String> {
    let root_stat = read_stat(root).map_err(|e| format!("the server (pid {root}) is gone: {e}"))?;
    let mut stats: HashMap<u32, Stat> = HashMap::new();
    for pid in proc_pids() {
        if let Ok(stat) = read_stat(pid) {
            stats.insert(pid, stat);
        }
    }
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (&pid, stat) in &stats {
        children.entry(stat.ppid).or_default().push(pid);
    }
    let mut total = root_stat.ticks;
    let mut queue = children.get(&root).cloned().unwrap_or_default();
    while let Some(pid) = queue.pop() {
        if let Some(stat) = stats.get(&pid) {
            total += stat.ticks;
        }
        if let Some(more) = children.get(&pid) {
            queue.extend(more);
        }
    }
    Ok((root_stat, total))
}

// --- the meter --------------------------------------------------------------------------------------

/// This process's CPU time so far, with its user/system split when `/proc/self/stat` has it.
#[derive(Debug, Clone, Copy)]
struct ClientCpu {
    total: Duration,
    split: Option<(u64, u64)>,
}

impl ClientCpu {
    fn now() -> Self {
        let split = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|text| parse_stat(&text))
            .map(|s| (s.user, s.system));
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        let total = Duration::new(
            u64::try_from(t.tv_sec).unwrap_or(0),
            u32::try_from(t.tv_nsec).unwrap_or(0),
        );
        Self { total, split }
    }
}

/// Measures the client's and the server's CPU time over one interval (see the module doc).
#[derive(Debug)]
pub struct CpuMeter<'a> {
    server: &'a ServerCpu,
    server_start: Option<Result<Duration, String>>,
    client_start: ClientCpu,
}

impl<'a> CpuMeter<'a> {
    /// Reads the server, then the client: call it right before the measured interval starts.
    pub async fn start(server: &'a ServerCpu) -> CpuMeter<'a> {
        let server_start = server.read().await;
        CpuMeter {
            server,
            server_start,
            client_start: ClientCpu::now(),
        }
    }

    /// Reads the client, then the server: call it right after the measured interval ended.
    pub async fn stop(self) -> CpuSpent {
        let client_end = ClientCpu::now();
        let server_end = self.server.read().await;
        let client = client_end.total.saturating_sub(self.client_start.total);
        let client_system_share = match (self.client_start.split, client_end.split) {
            (Some((u0, s0)), Some((u1, s1))) if u1 + s1 > u0 + s0 => {
                Some((s1 - s0) as f64 / ((u1 - u0) + (s1 - s0)) as f64)
            }
            _ => None,
        };
        let (server, server_source) = match (self.server_start, server_end) {
            (Some(Ok(a)), Some(Ok(b))) => (Some(b.saturating_sub(a)), self.server.source.clone()),
            (Some(Err(e)), _) | (_, Some(Err(e))) => (
                None,
                format!("none: {} failed to read: {e}", self.server.source),
            ),
            _ => (None, self.server.source.clone()),
        };
        CpuSpent {
            client,
            client_system_share,
            server,
            in_process: self.server.in_process,
            server_source,
        }
    }
}

/// CPU time spent over one measured interval.
#[derive(Debug, Clone)]
pub struct CpuSpent {
    /// The bench process, every thread, user + system.
    pub client: Duration,
    /// The kernel's share of `client`, in [0, 1] (10 ms ticks: absent over short intervals).
    pub client_system_share: Option<f64>,
    /// The server(s); `None` without a source, or when a reading failed.
    pub server: Option<Duration>,
    /// No server: the client's figure is the whole cost.
    pub in_process: bool,
    pub server_source: String,
}

impl CpuSpent {
    /// Spent nothing, measured by nothing: for results built without a meter (tests).
    pub fn none() -> Self {
        Self {
            client: Duration::ZERO,
            client_system_share: None,
            server: None,
            in_process: false,
            server_source: "none: not measured".to_string(),
        }
    }

    /// The figures per one of `n` things done in the interval (cycles, acquisitions, calls, ticks).
    /// With `n` = 0 the server and total figures are `None` (and the client's 0), and the server's
    /// source says "none: nothing counted": no cost per nothing.
    pub fn per(&self, n: u64) -> CpuFigures {
        let per = |d: Duration| {
            if n == 0 {
                0.0
            } else {
                round2(d.as_secs_f64() * 1e6 / n as f64)
            }
        };
        let client = per(self.client);
        // Nothing counted: no cost per cycle (0 µs would make every CPU target "met").
        let server = self.server.filter(|_| n > 0).map(per);
        let total = match (server, self.in_process) {
            _ if n == 0 => None,
            (Some(server), _) => Some(round2(client + server)),
            (None, true) => Some(client),
            (None, false) => None,
        };
        CpuFigures {
            client_us_per_cycle: client,
            server_us_per_cycle: server,
            total_us_per_cycle: total,
            client_system_share: self.client_system_share.map(round2),
            client_cpu_s: round3(self.client.as_secs_f64()),
            server_cpu_s: self.server.map(|d| round3(d.as_secs_f64())),
            client_source: CLIENT_SOURCE.to_string(),
            server_source: if n == 0 {
                format!("none: nothing counted (0 cycles); {}", self.server_source)
            } else {
                self.server_source.clone()
            },
        }
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// CPU time per cycle (per acquisition in the contended workload, per call for a round-trip probe).
#[derive(Debug, Clone, Serialize)]
pub struct CpuFigures {
    /// The bench process (distlock or the baseline client, with the runtime), µs per cycle.
    pub client_us_per_cycle: f64,
    /// The server(s), µs per cycle; null without a source (see `server_source`) or with 0 cycles.
    pub server_us_per_cycle: Option<f64>,
    /// Client + server; the client alone when there is no server (in-process engines); null when a
    /// server exists but its CPU could not be read, or when nothing was counted (0 cycles).
    pub total_us_per_cycle: Option<f64>,
    /// The kernel's share of the client's CPU, in [0, 1] (10 ms ticks).
    pub client_system_share: Option<f64>,
    /// The totals over the measured interval, in seconds.
    pub client_cpu_s: f64,
    pub server_cpu_s: Option<f64>,
    pub client_source: String,
    /// "redis INFO cpu", "etcd process_cpu_seconds_total", "/proc/<pid>/stat of the local server",
    /// or "none: <why>".
    pub server_source: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_info_cpu_is_user_plus_sys() {
        let info = "# CPU\r\nused_cpu_sys:1.250000\r\nused_cpu_user:0.500001\r\n\
                    used_cpu_sys_children:9.000000\r\nused_cpu_user_children:0.000000\r\n";
        assert_eq!(
            parse_redis_info_cpu(info),
            Ok(Duration::from_micros(1_750_001))
        );
        assert!(parse_redis_info_cpu("# CPU\r\n").is_err());
    }

    /// Nothing done in the interval (a contended run where every wait gave up, a hold whose
    /// renewals were not counted): no per-cycle figure, not a cost of 0 µs that meets every target.
    #[test]
    fn nothing_done_has_no_cost_per_cycle() {
        let spent = CpuSpent {
            client: Duration::from_millis(3),
            client_system_share: None,
            server: Some(Duration::from_millis(2)),
            in_process: false,
            server_source: "redis INFO cpu".to_string(),
        };
        let f = spent.per(0);
        assert_eq!(f.total_us_per_cycle, None);
        assert_eq!(f.server_us_per_cycle, None);
        assert_eq!(f.client_cpu_s, 0.003);
        assert!(f.server_source.starts_with("none: "), "{}", f.server_source);
        let f = spent.per(4);
        assert_eq!(f.total_us_per_cycle, Some(1250.0));
        let in_process = CpuSpent {
            in_process: true,
            server: None,
            ..spent
        };
        assert_eq!(in_process.per(0).total_us_per_cycle, None);
    }

    #[test]
    fn exponent_notation_in_metrics() {
        let page = "process_cpu_seconds_total 1.23e+01\n";
        assert_eq!(parse_metric(page, "process_cpu_seconds_total"), Some(12.3));
    }

    #[test]
    fn metrics_page() {
        let page = "# HELP process_cpu_seconds_total Total user and system CPU time\n\
                    # TYPE process_cpu_seconds_total counter\n\
                    process_cpu_seconds_total 12.34\nprocess_cpu_seconds_total_x 1\n";
        assert_eq!(parse_metric(page, "process_cpu_seconds_total"), Some(12.34));
        assert_eq!(parse_metric("x 1\n", "process_cpu_seconds_total"), None);
    }

    #[test]
    fn proc_tables() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:4E21 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 12345 1 0 100 0 0 10 0\n\
   1: 0100007F:4E21 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 12346 1 0 100 0 0 10 0\n\
   2: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 777 1 0 100 0 0 10 0\n";
        assert_eq!(listening_inodes(tcp, 0x4E21), [12345]);
        let stat =
            "4242 (redis server) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 70 3 4 20 0 4 0 1 1 1";
        let s = parse_stat(stat).expect("stat");
        assert_eq!((s.ppid, s.user, s.system, s.ticks), (1, 250, 70, 327));
        assert!(is_loopback("127.0.0.1") && is_loopback("::1") && is_loopback("[::1]"));
        assert!(is_loopback("localhost") && !is_loopback("10.0.0.1") && !is_loopback("db"));
    }

    /// This process's own CPU, by both readers: the tree reader finds it and the client clock moves.
    #[test]
    fn this_process_is_measured() {
        let pid = std::process::id();
        let before = ClientCpu::now().total;
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(ClientCpu::now().total > before);
        assert!(proc_tree_cpu(pid).is_ok());
    }

    #[tokio::test]
    async fn finds_the_process_listening_on_a_loopback_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        assert_eq!(
            local_server_pid("127.0.0.1", port).await,
            Ok(std::process::id())
        );
        assert!(local_server_pid("192.0.2.1", port).await.is_err());
    }
}
