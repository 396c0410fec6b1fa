//! A real server process owned by a test: spawned in its own process group, logged to its temp dir,
//! probed for protocol-level readiness, and killed (group and all) when the handle drops.
//!
//! # How leftovers are prevented
//!
//! * `Drop` SIGKILLs the whole process group and reaps the leader — also during a panic unwind, when it
//!   additionally keeps the temp dir and prints its path and the log tail to stderr.
//! * Every child gets `PR_SET_PDEATHSIG(SIGKILL)`. Linux ties that signal to the *thread* that forked,
//!   and tests run on short-lived threads, so all spawns go through one dedicated spawner thread that
//!   lives as long as the test process: when the process dies (even by SIGKILL, when no `Drop` runs) its
//!   servers die with it. The signal is set in `pre_exec`, which std runs after `uid`/`gid` switches
//!   (those clear it), and the child exits at once if its parent is already gone. Both pieces are
//!   `distlock-process`'s, shared with the `distlock run` supervisor.
//! * A pid record per server (see [`crate::sweep`]) lets the next run kill what escaped both.
//!
//! # Identity
//!
//! A port can be taken between reservation and the server's `bind`; the server then exits and a probe
//! would reach *someone else's* server. So every readiness probe first checks, without reaping, that
//! the child is still alive, and a probe may also compare the pid the server reports (Redis: `INFO
//! server` → `process_id`) with the child's.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read as _, Seek as _, SeekFrom, Write as _};
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};
use tempfile::TempDir;

use crate::error::{Error, Result};
use crate::ports::PortLease;
use crate::sweep::{self, PidRecord};

/// How long a server gets to become ready after (re)spawn.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between readiness probes.
pub const READY_POLL: Duration = Duration::from_millis(15);
/// How long [`ServerProcess::stop`] waits after SIGTERM before it uses SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Log lines printed when a handle is dropped during a panic.
const PANIC_LOG_LINES: usize = 50;

/// What to run. Built once; [`ServerProcess::restart`] runs it again unchanged.
#[derive(Debug, Clone)]
pub struct ServerSpec {
    name: String,
    program: OsString,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    env_remove: Vec<OsString>,
    current_dir: Option<PathBuf>,
    uid: Option<u32>,
    gid: Option<u32>,
    install_hint: String,
}

impl ServerSpec {
    /// A spec for `program`; `name` names the log file (`<dir>/<name>.log`) and appears in errors.
    pub fn new(name: impl Into<String>, program: impl Into<OsString>) -> Self {
        ServerSpec {
            name: name.into(),
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            env_remove: Vec::new(),
            current_dir: None,
            uid: None,
            gid: None,
            install_hint: "run scripts/setup.sh".to_owned(),
        }
    }

    /// Appends one argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Appends arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable (e.g. `LD_PRELOAD` for libfaketime).
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Removes an inherited environment variable.
    pub fn env_remove(mut self, key: impl Into<OsString>) -> Self {
        self.env_remove.push(key.into());
        self
    }

    /// Working directory of the server; defaults to the server's temp dir.
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.current_dir = Some(dir.into());
        self
    }

    /// Runs the server as this uid, for servers that refuse root (PostgreSQL). Set with `Command::uid`,
    /// so the pid stays the server's (su/runuser would fork).
    pub fn uid(mut self, uid: u32) -> Self {
        self.uid = Some(uid);
        self
    }

    /// Runs the server with this gid.
    pub fn gid(mut self, gid: u32) -> Self {
        self.gid = Some(gid);
        self
    }

    /// How to install the program, shown when it is missing, e.g. `apt-get install -y redis-server`.
    pub fn install_hint(mut self, hint: impl Into<String>) -> Self {
        self.install_hint = hint.into();
        self
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The program.
    pub fn program(&self) -> &OsStr {
        &self.program
    }

    /// The arguments.
    pub fn get_args(&self) -> &[OsString] {
        &self.args
    }

    fn program_display(&self) -> String {
        self.program.to_string_lossy().into_owned()
    }

    fn missing(&self) -> Error {
        Error::MissingBinary {
            program: self.program_display(),
            hint: self.install_hint.clone(),
        }
    }
}

/// What one readiness probe saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The server answers at protocol level and is ours.
    Ready,
    /// Not yet; the reason is reported if the deadline passes.
    NotYet(String),
}

/// A readiness probe, called with the child's pid until it returns [`Probe::Ready`]. It should use short
/// I/O timeouts of its own: the loop checks the deadline only between calls.
pub type ReadyProbe = Arc<dyn Fn(u32) -> Probe + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunState {
    Running,
    Paused,
    /// Killed or stopped and reaped; `restart` brings it back.
    Down,
}

/// A running server owned by a test. See the module docs for how it is cleaned up.
pub struct ServerProcess {
    spec: ServerSpec,
    probe: ReadyProbe,
    child: Option<Child>,
    record: Option<PidRecord>,
    pid: u32,
    state: RunState,
    log_path: PathBuf,
    ports: Vec<PortLease>,
    /// `None` once kept (after a failed start), so it is not deleted.
    dir: Option<TempDir>,
    dir_path: PathBuf,
}

impl fmt::Debug for ServerProcess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerProcess")
            .field("name", &self.spec.name)
            .field("pid", &self.pid)
            .field("state", &self.state)
            .field("ports", &self.ports())
            .field("dir", &self.dir_path)
            .finish_non_exhaustive()
    }
}

/// A fresh temp dir for one server, `$TMPDIR/distlock-<name>-XXXXXX`.
pub fn temp_dir(name: &str) -> Result<TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("distlock-{name}-"))
        .tempdir()
        .map_err(|e| Error::io(format!("creating a temp dir for {name}"), e))
}

impl ServerProcess {
    /// Spawns `spec` with its data in `dir`, keeps `ports` reserved for the server's lifetime, and waits
    /// until `probe` says ready (30 s deadline, the child must stay alive throughout).
    ///
    /// On failure the child is killed and the temp dir is kept; the error names it and carries the log
    /// tail.
    pub fn spawn(
        spec: ServerSpec,
        dir: TempDir,
        ports: Vec<PortLease>,
        probe: ReadyProbe,
    ) -> Result<ServerProcess> {
        sweep::sweep_once();
        check_program(&spec)?;
        let dir_path = dir.path().to_path_buf();
        let log_path = dir_path.join(format!("{}.log", spec.name));
        let mut server = ServerProcess {
            spec,
            probe,
            child: None,
            record: None,
            pid: 0,
            state: RunState::Down,
            log_path,
            ports,
            dir: Some(dir),
            dir_path,
        };
        if let Err(e) = server.launch() {
            server.keep_dir();
            return Err(e);
        }
        Ok(server)
    }

    /// Spawns the child, records it, and waits for readiness; on failure the child is killed.
    fn launch(&mut self) -> Result<()> {
        let started = Instant::now();
        let child = self.spawn_child()?;
        self.pid = child.id();
        self.child = Some(child);
        self.state = RunState::Running;
        match PidRecord::register(self.pid, &self.spec.name) {
            Ok(r) => self.record = Some(r),
            // Only the crash safety net is missing; the server itself is fine.
            Err(e) => tracing::warn!(error = %e, "could not write pid record"),
        }
        if let Err(e) = self.wait_ready() {
            self.kill_and_reap();
            return Err(e);
        }
        tracing::debug!(
            name = %self.spec.name,
            pid = self.pid,
            ports = ?self.ports(),
            elapsed = ?started.elapsed(),
            "server ready"
        );
        Ok(())
    }

    fn spawn_child(&self) -> Result<Child> {
        let spec = &self.spec;
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(|e| Error::io(format!("opening {}", self.log_path.display()), e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| Error::io("duplicating the log file handle", e))?;
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .current_dir(spec.current_dir.as_deref().unwrap_or(&self.dir_path))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0);
        for key in &spec.env_remove {
            cmd.env_remove(key);
        }
        for (key, value) in &spec.env {
            cmd.env(key, value);
        }
        if let Some(gid) = spec.gid {
            cmd.gid(gid);
        }
        if let Some(uid) = spec.uid {
            cmd.uid(uid);
        }
        // After the uid/gid switch (which clears it), and forked from the process-lifetime thread.
        distlock_process::die_with_parent(&mut cmd);
        distlock_process::spawn_on_spawner_thread(cmd).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                spec.missing()
            } else {
                Error::Spawn {
                    name: spec.name.clone(),
                    program: spec.program_display(),
                    source: e,
                }
            }
        })
    }

    fn wait_ready(&self) -> Result<()> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.exited()? {
                return Err(self.exited_error(status));
            }
            let last = match (self.probe)(self.pid) {
                Probe::Ready => {
                    // The probe may have raced the child's exit (another server answered): confirm.
                    return match self.exited()? {
                        Some(status) => Err(self.exited_error(status)),
                        None => Ok(()),
                    };
                }
                Probe::NotYet(why) => why,
            };
            if started.elapsed() >= READY_TIMEOUT {
                return Err(Error::NotReady {
                    name: self.spec.name.clone(),
                    pid: self.pid,
                    waited: started.elapsed(),
                    last,
                    dir: self.dir_path.clone(),
                    log_tail: self.log_tail(PANIC_LOG_LINES),
                });
            }
            std::thread::sleep(READY_POLL);
        }
    }

    fn exited_error(&self, status: ExitStatus) -> Error {
        Error::Exited {
            name: self.spec.name.clone(),
            status: describe(status),
            dir: self.dir_path.clone(),
            log_tail: self.log_tail(PANIC_LOG_LINES),
        }
    }

    /// The exit status if the child has exited, *without* reaping it: an unreaped zombie keeps its pid
    /// (and process group id) from being reused, so a later group kill cannot hit a stranger.
    fn exited(&self) -> Result<Option<ExitStatus>> {
        let Some(pid) = self.child_pid() else {
            return Ok(None);
        };
        let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
        match rustix::process::waitid(WaitId::Pid(pid), options) {
            Ok(Some(status)) => {
                let raw = if let Some(code) = status.exit_status() {
                    code << 8
                } else {
                    status.terminating_signal().unwrap_or(Signal::KILL.as_raw())
                };
                Ok(Some(ExitStatus::from_raw(raw)))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(Error::io(
                format!("checking whether {} is alive", self.spec.name),
                io::Error::from(e),
            )),
        }
    }

    fn child_pid(&self) -> Option<Pid> {
        self.child.as_ref().map(Pid::from_child)
    }

    /// SIGKILLs the group and every child that left it, drops the pid record (while the zombie still
    /// pins the pid), reaps, then waits for those children to be gone.
    fn kill_and_reap(&mut self) {
        let mut escaped = Vec::new();
        if let Some(pid) = self.child_pid() {
            // Children that left the group (PostgreSQL's backends `setsid`) would outlive the kill and
            // keep the server's shared memory attached, so a restart on the same data dir is refused.
            // The group first: a server whose child dies first may fork a new one (PostgreSQL's
            // crash recovery) before it dies itself.
            escaped = self.escaped_children();
            if let Err(e) = rustix::process::kill_process_group(pid, Signal::KILL) {
                if e != rustix::io::Errno::SRCH {
                    tracing::warn!(pid = self.pid, error = %e, "SIGKILL of the process group failed");
                }
            }
            signal_each(&escaped, Signal::KILL);
        }
        self.record = None;
        if let Some(mut child) = self.child.take() {
            if let Err(e) = child.wait() {
                tracing::warn!(pid = self.pid, error = %e, "waiting for the killed server failed");
            }
        }
        for (child, _) in escaped {
            if !sweep::gone_within(child, STOP_TIMEOUT) {
                tracing::warn!(pid = child, "a killed server's child is still running");
            }
        }
        self.state = RunState::Down;
    }

    fn signal_group(&self, sig: Signal, what: &str) -> Result<()> {
        let pid = self.child_pid().ok_or_else(|| {
            Error::State(format!(
                "cannot {what} {}: it is not running",
                self.spec.name
            ))
        })?;
        rustix::process::kill_process_group(pid, sig).map_err(|e| {
            Error::io(
                format!("{what} {} (pid {})", self.spec.name, self.pid),
                io::Error::from(e),
            )
        })
    }

    /// The server's pid (also its process group id). After a restart, the new one.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the server is running (not paused, not killed, not exited on its own).
    pub fn is_running(&self) -> bool {
        self.state == RunState::Running && matches!(self.exited(), Ok(None))
    }

    /// The reserved ports, in the order they were given.
    pub fn ports(&self) -> Vec<u16> {
        self.ports.iter().map(PortLease::port).collect()
    }

    /// The port leases, e.g. for a Cluster node's bus port.
    pub fn leases(&self) -> &[PortLease] {
        &self.ports
    }

    /// The server's temp dir (data and log).
    pub fn dir(&self) -> &Path {
        &self.dir_path
    }

    /// The log file (`<dir>/<name>.log`; stdout and stderr, across restarts).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The spec it runs.
    pub fn spec(&self) -> &ServerSpec {
        &self.spec
    }

    /// kill -9 of the whole process group, then reap. The data dir and ports stay for [`restart`].
    ///
    /// [`restart`]: ServerProcess::restart
    pub fn kill9(&mut self) -> Result<()> {
        if self.child.is_none() {
            return Err(Error::State(format!(
                "cannot kill {}: it is not running",
                self.spec.name
            )));
        }
        self.kill_and_reap();
        Ok(())
    }

    /// Starts the server again with the same program, args, data dir and ports, and waits until ready.
    /// A server that is still running (or paused) is killed with SIGKILL first.
    pub fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            self.kill_and_reap();
        }
        self.append_log_marker("restart");
        if let Err(e) = self.launch() {
            self.keep_dir();
            return Err(e);
        }
        Ok(())
    }

    /// SIGSTOP to the process group and every child that left it (PostgreSQL's backends): the server
    /// keeps its sockets but answers nothing.
    pub fn pause(&mut self) -> Result<()> {
        let escaped = self.escaped_children();
        self.signal_group(Signal::STOP, "pause")?;
        signal_each(&escaped, Signal::STOP);
        self.state = RunState::Paused;
        Ok(())
    }

    /// SIGCONT to the process group and every child that left it.
    pub fn resume(&mut self) -> Result<()> {
        let escaped = self.escaped_children();
        self.signal_group(Signal::CONT, "resume")?;
        signal_each(&escaped, Signal::CONT);
        self.state = RunState::Running;
        Ok(())
    }

    /// The server's descendants that are not in its process group (a group signal misses them), with
    /// their start times. Read while the server lives: once it is gone they belong to init.
    fn escaped_children(&self) -> Vec<(u32, u64)> {
        let group = self.pid;
        sweep::descendants(self.pid)
            .into_iter()
            .filter(|&(child, _)| sweep::process_group_of(child) != Some(group))
            .collect()
    }

    /// Graceful stop: SIGTERM (and SIGCONT, in case it is paused) to the group, then SIGKILL if it has
    /// not exited within [`STOP_TIMEOUT`]; children that left the group are resumed and killed with it.
    /// Returns how the server exited.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        // Read before the server goes: once it has exited they belong to init. A paused server's
        // stopped backends would otherwise outlive it, stopped, holding its shared memory.
        let mut escaped = self.escaped_children();
        self.signal_group(Signal::TERM, "stop")?;
        let _ = self.signal_group(Signal::CONT, "continue");
        signal_each(&escaped, Signal::CONT);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if self.exited()?.is_some() {
                break;
            }
            std::thread::sleep(READY_POLL);
        }
        if self.exited()?.is_none() {
            tracing::warn!(name = %self.spec.name, pid = self.pid, "no exit after SIGTERM; SIGKILL");
            // It may have forked more since (still alive, so its pid is still its own).
            for child in self.escaped_children() {
                if !escaped.contains(&child) {
                    escaped.push(child);
                }
            }
        }
        // Kill the rest of the group (forked helpers) before reaping the leader.
        if let Some(pid) = self.child_pid() {
            let _ = rustix::process::kill_process_group(pid, Signal::KILL);
        }
        signal_each(&escaped, Signal::KILL);
        self.record = None;
        let status = match self.child.take() {
            Some(mut child) => child
                .wait()
                .map_err(|e| Error::io(format!("waiting for {}", self.spec.name), e))?,
            None => ExitStatus::from_raw(0),
        };
        for (child, _) in escaped {
            if !sweep::gone_within(child, STOP_TIMEOUT) {
                tracing::warn!(pid = child, "a stopped server's child is still running");
            }
        }
        self.state = RunState::Down;
        Ok(status)
    }

    /// The last `n` lines of the server's log (empty if there is none yet).
    pub fn log_tail(&self, n: usize) -> String {
        log_tail(&self.log_path, n)
    }

    fn append_log_marker(&self, what: &str) {
        if let Ok(mut f) = OpenOptions::new().append(true).open(&self.log_path) {
            let _ = writeln!(f, "---- distlock-testkit: {what} ----");
        }
    }

    /// Keeps the temp dir on disk after the handle is gone (for post-mortems).
    pub fn keep_dir(&mut self) -> &Path {
        if let Some(dir) = self.dir.take() {
            let _ = dir.keep();
        }
        &self.dir_path
    }
}

/// `sig` to each of `processes` that still is the process it was (same pid and start time).
fn signal_each(processes: &[(u32, u64)], sig: Signal) {
    for &(pid, started) in processes {
        if sweep::start_time(pid) != Some(started) {
            continue;
        }
        if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, sig);
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill_and_reap();
        if std::thread::panicking() {
            self.keep_dir();
            eprintln!(
                "distlock-testkit: test panicked; kept {} (pid {}) dir {}\n--- last {PANIC_LOG_LINES} lines of {} ---\n{}",
                self.spec.name,
                self.pid,
                self.dir_path.display(),
                self.log_path.display(),
                self.log_tail(PANIC_LOG_LINES),
            );
        }
    }
}

/// The last `n` lines of a file, reading at most its last 256 KiB.
pub fn log_tail(path: &Path, n: usize) -> String {
    const MAX: u64 = 256 * 1024;
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if len > MAX && f.seek(SeekFrom::Start(len - MAX)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    if f.read_to_end(&mut buf).is_err() {
        return String::new();
    }
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => status.to_string(),
    }
}

/// Fails early, with the install command, when the program is not on PATH.
fn check_program(spec: &ServerSpec) -> Result<()> {
    let program = Path::new(&spec.program);
    let found = if program.components().count() > 1 {
        is_executable(program)
    } else {
        std::env::var_os("PATH")
            .map(|path| std::env::split_paths(&path).any(|d| is_executable(&d.join(program))))
            .unwrap_or(false)
    };
    if found {
        Ok(())
    } else {
        Err(spec.missing())
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}
