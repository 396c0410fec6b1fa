//! The supervisor: a small process between `distlock` and the command, so that nothing the command
//! starts outlives the hold (DESIGN §9 "The CLI").
//!
//! `distlock run` re-executes its own binary as `distlock __supervise …` (single-threaded, no async
//! runtime). The supervisor
//!
//! * is a child subreaper (`PR_SET_CHILD_SUBREAPER`): every orphaned descendant of the command, also
//!   one that called `setsid` or daemonized, is reparented to it, so "no child left" means "no
//!   descendant left";
//! * starts the command as the leader of its own process group, with SIGKILL as its parent-death
//!   signal (so the command dies if the supervisor is killed);
//! * talks to `distlock` over a socket pair: end-of-file on it means `distlock` is gone (killed, say by
//!   the OOM killer), and the supervisor then kills the whole tree at once;
//! * on the file backend, holds a duplicate of the `flock`ed descriptor (inherited; close-on-exec set
//!   again before the command is started, so the command never sees it): if `distlock` dies the kernel
//!   frees the lock only when the supervisor exits, which is after the last descendant is gone.
//!
//! Killing the tree: descendants are found by a `/proc` scan (parent links from the supervisor down),
//! stopped with SIGSTOP until no new one appears (a forking process cannot outrun the scan), then
//! SIGKILLed, and reaped until `waitpid` reports no child.
//!
//! The protocol, one line per message.
//! distlock → supervisor: `s N` (send signal N to the command's process group, while its leader is
//! unreaped), `t` (SIGTERM every descendant, SIGKILL them all after the grace), `k` (SIGKILL every
//! descendant now), `c` (continue the stopped command, with the terminal if distlock has it again).
//! supervisor → distlock: `p PID` (the command started), `e ERRNO` (it could not be started), `z N`
//! (the command, which had the terminal, was stopped by signal N, as by Ctrl-Z; the terminal is
//! distlock's again, and distlock stops itself so its shell sees the job stopped), `x RAW` (the command
//! exited with wait status RAW), `d` (every descendant is gone; the supervisor exits).

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

/// The hidden subcommand (`distlock __supervise`); not in `--help`.
pub const SUBCOMMAND: &str = "__supervise";

/// What `distlock` starts the supervisor with.
///
/// [`crate::child::spawn`] passes it on the supervisor's command line, `distlock __supervise <args> CMD
/// ARGS…`, where [`main`] parses it back:
///
/// ```
/// use distlock_cli::supervisor::Invocation;
/// use std::time::Duration;
///
/// let invocation = Invocation {
///     control: 5, // the supervisor's end of the socket pair, inherited
///     lock: None, // no descriptor to keep (not the file backend)
///     grace: Duration::from_secs(10),
///     terminal: false,
///     terminal_on_demand: false,
/// };
/// assert_eq!(invocation.to_args(), ["5", "-", "10000", "0", "--"]);
/// ```
#[derive(Debug)]
pub struct Invocation {
    /// The supervisor's end of the control socket.
    pub control: RawFd,
    /// The lock's inheritable descriptor, if the backend has one.
    pub lock: Option<RawFd>,
    /// How long descendants get between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Hand the controlling terminal to the command's process group, and back afterwards.
    pub terminal: bool,
    /// Hand it over only once a process of the command's group is stopped for want of it (SIGTTIN,
    /// SIGTTOU): another process of distlock's group (a pager after it in a pipeline) reads it too.
    pub terminal_on_demand: bool,
}

impl Invocation {
    /// The arguments after the subcommand, up to and including `--`.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            self.control.to_string(),
            self.lock
                .map_or_else(|| "-".to_string(), |fd| fd.to_string()),
            // Saturated: a grace of 2^64 ms (half a billion years) is forever anyway.
            u64::try_from(self.grace.as_millis())
                .unwrap_or(u64::MAX)
                .to_string(),
            if self.terminal_on_demand {
                "2".to_string()
            } else {
                u8::from(self.terminal).to_string()
            },
            "--".to_string(),
        ]
    }

    fn parse(args: &[OsString]) -> Option<(Self, &[OsString])> {
        let text = |i: usize| args.get(i).and_then(|a| a.to_str());
        let control = text(0)?.parse().ok()?;
        let lock = match text(1)? {
            "-" => None,
            fd => Some(fd.parse().ok()?),
        };
        let grace = Duration::from_millis(text(2)?.parse().ok()?);
        let terminal = text(3)? == "1";
        let terminal_on_demand = text(3)? == "2";
        if text(4)? != "--" || args.len() < 6 {
            return None;
        }
        Some((
            Self {
                control,
                lock,
                grace,
                terminal,
                terminal_on_demand,
            },
            &args[5..],
        ))
    }
}

/// Runs the supervisor; `args` are those after the subcommand. Returns the process exit code.
pub fn main(args: &[OsString]) -> i32 {
    let Some((invocation, command)) = Invocation::parse(args) else {
        crate::exit::report("internal error: bad supervisor arguments");
        return crate::exit::Code::Usage.as_i32();
    };
    // SAFETY: `distlock` passed us this descriptor number for exactly this; nothing else owns it.
    let control = unsafe { UnixStream::from_raw_fd(invocation.control) };
    // Neither descriptor may reach the command, and every descendant must stay ours: if either cannot
    // be had, the command does not start (distlock sees the supervisor exit and reports it).
    let prepared = set_cloexec(control.as_raw_fd())
        .and_then(|()| invocation.lock.map_or(Ok(()), set_cloexec))
        .and_then(|()| become_subreaper());
    if let Err(error) = prepared {
        crate::exit::report(format!(
            "the supervisor cannot keep the command's processes in hand: {error}"
        ));
        return crate::exit::Code::CannotExecute.as_i32();
    }
    let mut supervisor = Supervisor::new(control, invocation);
    supervisor.run(command);
    0
}

fn set_cloexec(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor number; an invalid one fails with EBADF.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Signals the supervisor ignores (the command gets them back as the supervisor inherited them). Its job ends only when
/// the tree is gone, so what would end it early must not: SIGTTOU (it hands the terminal over and takes
/// it back from a background group); SIGHUP, which the kernel sends to a stopped process whose group is
/// orphaned (as its group is once `distlock` dies); and SIGINT, SIGTERM, SIGQUIT sent to every process
/// of a service at stop (systemd) or by name, which `distlock` forwards to the command anyway.
const IGNORED: [i32; 5] = [
    libc::SIGTTOU,
    libc::SIGHUP,
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGQUIT,
];

struct Supervisor {
    /// `None` once distlock is gone.
    control: Option<UnixStream>,
    /// Bytes read from `control` that do not end a line yet.
    pending: Vec<u8>,
    grace: Duration,
    /// The terminal's foreground process group to restore, when the command was given the terminal.
    terminal: Option<libc::pid_t>,
    /// The controlling terminal (`/dev/tty`, close-on-exec), when the command is given it.
    tty: Option<std::fs::File>,
    /// distlock's process group, while the terminal is to be handed over on demand and has not been.
    terminal_on_demand: Option<libc::pid_t>,
    /// The command, until reaped.
    leader: Option<libc::pid_t>,
    /// Readable once the leader has exited (`pidfd_open`; `None` on kernels without it).
    leader_fd: Option<std::os::fd::OwnedFd>,
    /// SIGKILL every descendant at this instant (after a SIGTERM).
    kill_at: Option<Instant>,
    /// SIGKILL every descendant now and until none is left.
    killing: bool,
    /// Every process below this one.
    tree: Tree,
    /// The dispositions of [`IGNORED`] this process started with, given back to the command.
    inherited: [libc::sighandler_t; IGNORED.len()],
}

impl Supervisor {
    fn new(control: UnixStream, invocation: Invocation) -> Self {
        let tty = (invocation.terminal || invocation.terminal_on_demand)
            .then(open_tty)
            .flatten();
        let foreground = tty
            .as_ref()
            // SAFETY: plain system call on an open descriptor.
            .map(|tty| unsafe { libc::tcgetpgrp(tty.as_raw_fd()) })
            .filter(|pgrp| *pgrp > 0);
        let (terminal, terminal_on_demand) = if invocation.terminal_on_demand {
            (None, foreground)
        } else {
            (foreground, None)
        };
        Self {
            control: Some(control),
            pending: Vec::new(),
            grace: invocation.grace,
            terminal,
            tty,
            terminal_on_demand,
            leader: None,
            leader_fd: None,
            kill_at: None,
            killing: false,
            tree: Tree::default(),
            inherited: [libc::SIG_DFL; IGNORED.len()],
        }
    }

    fn send(&mut self, line: &str) {
        // distlock may be gone; that is seen as end-of-file on the next read.
        if let Some(control) = self.control.as_mut() {
            let _ = control.write_all(format!("{line}\n").as_bytes());
        }
    }

    fn run(&mut self, command: &[OsString]) {
        // SAFETY: prctl and signal with constant arguments.
        unsafe {
            // `ps` and `pkill` see "distlock-super" rather than "exe".
            libc::prctl(libc::PR_SET_NAME, c"distlock-super".as_ptr(), 0, 0, 0);
            for (signo, inherited) in IGNORED.iter().zip(self.inherited.iter_mut()) {
                // What exec left: the default, or ignored (nohup), which the command inherits too.
                let previous = libc::signal(*signo, libc::SIG_IGN);
                *inherited = if previous == libc::SIG_IGN {
                    libc::SIG_IGN
                } else {
                    libc::SIG_DFL
                };
            }
        }
        let inherited = self.inherited;
        let give_terminal = self.terminal.is_some();
        let tty = self.tty_fd();
        let mut cmd = std::process::Command::new(&command[0]);
        cmd.args(&command[1..]).process_group(0);
        // SAFETY: between fork and exec only async-signal-safe calls (tcsetpgrp, getpid, signal): no
        // allocation, no locks.
        unsafe {
            cmd.pre_exec(move || {
                if give_terminal {
                    // Also done by the supervisor; doing it here too means the command never reads
                    // the terminal before it owns it.
                    libc::tcsetpgrp(tty, libc::getpid());
                }
                for (signo, disposition) in IGNORED.iter().zip(inherited) {
                    libc::signal(*signo, disposition);
                }
                Ok(())
            });
        }
        // The supervisor is single-threaded: its forking thread lives as long as it does.
        distlock_process::die_with_parent(&mut cmd);
        let child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                self.send(&format!("e {}", e.raw_os_error().unwrap_or(libc::EIO)));
                self.restore_terminal();
                return;
            }
        };
        let pid = child.id() as libc::pid_t;
        // Reaped by waitpid below, not by std.
        drop(child);
        self.leader = Some(pid);
        if give_terminal {
            // SAFETY: plain system call.
            unsafe { libc::tcsetpgrp(tty, pid) };
        }
        self.leader_fd = pidfd_open(pid);
        self.send(&format!("p {pid}"));
        self.supervise();
        self.restore_terminal();
        self.send("d");
    }

    /// Until the command and every descendant are gone.
    fn supervise(&mut self) {
        loop {
            if !self.reap() {
                return;
            }
            let now = Instant::now();
            if self.kill_at.is_some_and(|at| at <= now) {
                self.kill_at = None;
                self.killing = true;
            }
            if self.killing {
                self.tree.kill_all();
            } else {
                self.hand_over_terminal_on_demand();
            }
            let timeout = if self.killing && self.tree.unkillable.is_empty() {
                Duration::from_millis(10)
            } else if self.killing {
                // Waiting for a process we may not signal: no need to rescan /proc 100 times a second.
                Duration::from_millis(200)
            } else if self.leader.is_none() {
                // Waiting for leftovers to exit after SIGTERM: no exit notification for them.
                Duration::from_millis(20)
            } else {
                // Orphans that die are reaped on this tick, and a stop of a command that has the
                // terminal is noticed (it makes no pidfd readable).
                let tick = if self.terminal_on_demand.is_some() {
                    // A /proc scan each: a prompt waits a moment, a long build is not taxed.
                    Duration::from_millis(250)
                } else if self.leader_fd.is_some() && self.terminal.is_none() {
                    Duration::from_secs(1)
                } else {
                    Duration::from_millis(50)
                };
                self.kill_at
                    .map_or(tick, |at| at.saturating_duration_since(now).min(tick))
            };
            self.wait_for_input(timeout);
        }
    }

    /// Reaps every exited child; reports the command's exit and starts the leftovers' termination.
    /// `false` once no child is left (and the command has been reaped).
    fn reap(&mut self) -> bool {
        let mut leader_exited = false;
        loop {
            let mut status = 0;
            // SAFETY: waitpid with a valid out pointer.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG | libc::WUNTRACED) };
            if pid > 0 && libc::WIFSTOPPED(status) {
                if Some(pid) == self.leader {
                    self.leader_stopped(libc::WSTOPSIG(status));
                }
                continue;
            }
            if pid > 0 {
                if Some(pid) == self.leader {
                    self.leader = None;
                    self.leader_fd = None;
                    self.restore_terminal();
                    self.send(&format!("x {status}"));
                    leader_exited = true;
                }
                continue;
            }
            if pid == 0 {
                // Children are left: when the command has just exited, they are leftover background
                // descendants: SIGTERM, SIGKILL after the grace. (No child left: no scan needed.)
                if leader_exited && !self.killing && self.kill_at.is_none() {
                    self.terminate_tree();
                }
                return true;
            }
            // ECHILD: nothing left (EINTR cannot happen with WNOHANG in practice; retry anyway).
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return self.leader.is_some();
        }
    }

    /// Waits up to `timeout` for a message from distlock or the command's exit, and acts on messages.
    fn wait_for_input(&mut self, timeout: Duration) {
        let mut fds = [
            libc::pollfd {
                fd: self.control.as_ref().map_or(-1, AsRawFd::as_raw_fd),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self
                    .leader_fd
                    .as_ref()
                    .map_or(-1, std::os::fd::AsRawFd::as_raw_fd),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = i32::try_from(timeout.as_millis())
            .unwrap_or(i32::MAX)
            .max(1);
        // SAFETY: poll over a valid array (a negative fd is ignored).
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if ready <= 0 || fds[0].revents == 0 {
            return;
        }
        let mut buf = [0u8; 256];
        let Some(control) = self.control.as_mut() else {
            return;
        };
        match control.read(&mut buf) {
            Ok(0) => self.distlock_gone(),
            Ok(n) => {
                self.pending.extend_from_slice(&buf[..n]);
                while let Some(end) = self.pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = self.pending.drain(..=end).collect();
                    self.handle(String::from_utf8_lossy(&line).trim());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => self.distlock_gone(),
        }
    }

    fn distlock_gone(&mut self) {
        // Nobody holds the lock for the tree any more (on a server, its lease still runs; on the
        // file backend, our descriptor keeps it until we exit): kill everything now.
        self.killing = true;
        self.control = None;
    }

    fn handle(&mut self, message: &str) {
        let mut parts = message.split_whitespace();
        match (
            parts.next(),
            parts.next().and_then(|n| n.parse::<i32>().ok()),
        ) {
            (Some("s"), Some(signo)) => {
                if let Some(leader) = self.leader {
                    // SAFETY: plain system call; the unreaped leader pins the group id.
                    unsafe { libc::kill(-leader, signo) };
                }
            }
            (Some("t"), _) => {
                if !self.killing {
                    self.terminate_tree();
                }
            }
            (Some("k"), _) => self.killing = true,
            (Some("c"), _) => self.continue_leader(),
            _ => crate::exit::report(format_args!(
                "internal error: unknown supervisor message {message:?}"
            )),
        }
    }

    /// SIGTERM (and SIGCONT, so a stopped one can act on it) to every descendant; SIGKILL after the
    /// grace, unless an earlier deadline is already set.
    fn terminate_tree(&mut self) {
        for pid in self.tree.descendants() {
            self.tree.signal(pid, libc::SIGTERM);
            self.tree.signal(pid, libc::SIGCONT);
        }
        let now = Instant::now();
        // No deadline representable: none at all (the grace is longer than the clock's range).
        let Some(at) = now.checked_add(self.grace) else {
            return;
        };
        self.kill_at = Some(self.kill_at.map_or(at, |earlier| earlier.min(at)));
    }

    /// The command, which has the terminal, stopped (Ctrl-Z, or reading the terminal after `bg`): the
    /// terminal goes back to distlock's group, and distlock is told, so that it stops too and its shell
    /// sees the job stopped and takes the terminal, as it would for the command alone.
    fn leader_stopped(&mut self, signo: i32) {
        let Some(pgrp) = self.terminal else {
            // No terminal handed over: nothing hangs on this stop; whoever stopped it continues it.
            return;
        };
        // SAFETY: plain system call (SIGTTOU is ignored here).
        unsafe { libc::tcsetpgrp(self.tty_fd(), pgrp) };
        self.send(&format!("z {signo}"));
    }

    /// distlock was continued (`fg` or `bg`): the command continues, with the terminal if distlock's
    /// group has it (`fg`).
    fn continue_leader(&mut self) {
        let Some(leader) = self.leader else {
            return;
        };
        if let Some(pgrp) = self.terminal {
            let tty = self.tty_fd();
            // SAFETY: plain system calls on the terminal (SIGTTOU is ignored here).
            unsafe {
                if libc::tcgetpgrp(tty) == pgrp {
                    libc::tcsetpgrp(tty, leader);
                }
            }
        }
        // SAFETY: plain system call; the unreaped leader pins the group id.
        unsafe { libc::kill(-leader, libc::SIGCONT) };
    }

    /// When the terminal is handed over on demand: once a process of the command's group is stopped
    /// (by SIGTTIN or SIGTTOU, reading or setting up the terminal from a background group: a password
    /// prompt) while distlock's group has the terminal, the command's group gets it and is continued.
    fn hand_over_terminal_on_demand(&mut self) {
        let (Some(pgrp), Some(leader)) = (self.terminal_on_demand, self.leader) else {
            return;
        };
        if !stopped_in_group(leader) {
            return;
        }
        let tty = self.tty_fd();
        // SAFETY: plain system calls on the terminal (SIGTTOU is ignored here) and the command's
        // group, pinned by its unreaped leader.
        unsafe {
            if libc::tcgetpgrp(tty) != pgrp || libc::tcsetpgrp(tty, leader) == -1 {
                return;
            }
            libc::kill(-leader, libc::SIGCONT);
        }
        self.terminal_on_demand = None;
        self.terminal = Some(pgrp);
    }

    /// The controlling terminal's descriptor, or -1 (calls on it then fail with EBADF).
    fn tty_fd(&self) -> RawFd {
        self.tty.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }

    fn restore_terminal(&mut self) {
        if let Some(pgrp) = self.terminal.take() {
            // SAFETY: plain system call (SIGTTOU is ignored here).
            unsafe { libc::tcsetpgrp(self.tty_fd(), pgrp) };
        }
    }
}

/// The processes below this one (found by parent links in `/proc`), and which of them may not be
/// signalled.
#[derive(Debug, Default)]
struct Tree {
    /// Descendants that could not be signalled (EPERM: one that changed its real user id, as sudo
    /// does), already reported.
    unkillable: HashSet<libc::pid_t>,
}

impl Tree {
    /// Stops every descendant until no new one appears, then SIGKILLs them all.
    fn kill_all(&mut self) {
        let mut stopped: HashSet<libc::pid_t> = HashSet::new();
        for _ in 0..100 {
            let fresh: Vec<libc::pid_t> = self
                .descendants()
                .into_iter()
                .filter(|pid| !stopped.contains(pid))
                .collect();
            if fresh.is_empty() {
                break;
            }
            for pid in fresh {
                self.signal(pid, libc::SIGSTOP);
                stopped.insert(pid);
            }
        }
        for pid in stopped {
            self.signal(pid, libc::SIGKILL);
        }
    }

    fn signal(&mut self, pid: libc::pid_t, signo: i32) {
        // SAFETY: plain system call.
        if unsafe { libc::kill(pid, signo) } == -1
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
            && self.unkillable.insert(pid)
        {
            crate::exit::report(format_args!(
                "cannot signal pid {pid}, a descendant of the command (not permitted: it changed its \
                 user id, as sudo and su do); waiting for it to exit"
            ));
        }
    }

    /// Every live (non-zombie) descendant, from a `/proc` scan.
    fn descendants(&self) -> Vec<libc::pid_t> {
        let me = std::process::id() as libc::pid_t;
        let mut children: HashMap<libc::pid_t, Vec<(libc::pid_t, bool)>> = HashMap::new();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<libc::pid_t>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // After "pid (comm)": state, ppid.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let mut fields = rest.split_whitespace();
            let zombie = matches!(fields.next(), Some("Z" | "X"));
            if let Some(ppid) = fields.next().and_then(|p| p.parse().ok()) {
                children.entry(ppid).or_default().push((pid, zombie));
            }
        }
        let mut found = Vec::new();
        let mut queue = vec![me];
        while let Some(parent) = queue.pop() {
            for &(pid, zombie) in children.get(&parent).map_or(&[][..], Vec::as_slice) {
                queue.push(pid);
                if !zombie {
                    found.push(pid);
                }
            }
        }
        found
    }
}

/// For `distlock` itself when its supervisor died without reporting the tree gone (SIGKILLed: the
/// command then dies by its parent-death signal, but its other descendants are orphaned). `distlock` is
/// a child subreaper too (see [`become_subreaper`]), so they are now its children: SIGKILL them all
/// and reap them until none is left. Returns only then (it waits for ones it may not signal).
pub fn kill_orphans() {
    let mut tree = Tree::default();
    loop {
        tree.kill_all();
        loop {
            let mut status = 0;
            // SAFETY: waitpid with a valid out pointer.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid > 0 {
                continue;
            }
            if pid == 0 {
                break;
            }
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // ECHILD: nothing left.
            return;
        }
        std::thread::sleep(if tree.unkillable.is_empty() {
            Duration::from_millis(10)
        } else {
            Duration::from_millis(200)
        });
    }
}

/// Makes this process a child subreaper, so that what its supervisor leaves orphaned if it dies is
/// reparented here (see [`kill_orphans`]).
pub fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: prctl with constant arguments.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether this process is alone in its process group but for its ancestors (a shell without job
/// control, a subshell): no pipeline sibling (`distlock run … | less`) shares the group and reads the
/// terminal too.
pub fn alone_in_process_group() -> bool {
    // SAFETY: plain system calls.
    let (me, group) = unsafe { (libc::getpid(), libc::getpgrp()) };
    let mut ancestors = HashSet::new();
    let mut pid = me;
    while let Some((_, ppid, _)) = stat(pid) {
        if ppid <= 0 || !ancestors.insert(ppid) {
            break;
        }
        pid = ppid;
    }
    !any_process(|pid, state, pgrp| {
        pid != me && !ancestors.contains(&pid) && pgrp == group && !matches!(state, 'Z' | 'X')
    })
}

/// Whether a process of process group `group` is stopped (by a signal; not a tracing stop).
fn stopped_in_group(group: libc::pid_t) -> bool {
    any_process(|_, state, pgrp| pgrp == group && state == 'T')
}

/// Whether `test(pid, state, process group)` holds for a process in `/proc`.
fn any_process(test: impl Fn(libc::pid_t, char, libc::pid_t) -> bool) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::pid_t>().ok())
            .and_then(|pid| stat(pid).map(|(state, _, pgrp)| (pid, state, pgrp)))
            .is_some_and(|(pid, state, pgrp)| test(pid, state, pgrp))
    })
}

/// The state letter, parent and process group of `pid`, from `/proc/PID/stat`.
fn stat(pid: libc::pid_t) -> Option<(char, libc::pid_t, libc::pid_t)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After "pid (comm)": state, ppid, pgrp.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some((state, ppid, pgrp))
}

/// The controlling terminal, whichever of stdin, stdout and stderr (or none) is connected to it: a
/// command in a pipeline still reads it through `/dev/tty` (password prompts).
pub fn open_tty() -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOCTTY)
        .open("/dev/tty")
        .ok()
}

fn pidfd_open(pid: libc::pid_t) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: the pidfd_open system call; a new descriptor is ours to own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = RawFd::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: a fresh descriptor returned by the kernel.
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}
