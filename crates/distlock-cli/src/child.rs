//! Starting the command under its supervisor (see [`crate::supervisor`]), talking to it, and the
//! signals `distlock` forwards.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use rustix::process::Signal;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::signal::unix::{signal, SignalKind};

use crate::supervisor::{Invocation, SUBCOMMAND};

/// What the child is started with.
///
/// [`spawn`] starts the running program again as the supervisor (`<program> __supervise …`), so a
/// program that spawns must hand that command line to [`crate::supervisor::main`] first thing in
/// `main`, as distlock's own does (the hidden lines of these examples do too).
///
/// ```
/// # fn main() -> std::io::Result<()> {
/// # // `spawn` starts this program again as `<program> __supervise …`: hand that to the supervisor,
/// # // as distlock's own `main` does.
/// # let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
/// # if argv.get(1).is_some_and(|a| a == distlock_cli::supervisor::SUBCOMMAND) {
/// #     std::process::exit(distlock_cli::supervisor::main(&argv[2..]));
/// # }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// use distlock_cli::child::{self, Event, Spec};
/// # use std::{ffi::OsString, time::Duration};
///
/// let args: [OsString; 2] = ["-c".into(), "exit $DISTLOCK_TOKEN".into()];
/// let spec = Spec {
///     program: "sh".as_ref(),
///     args: &args,
///     set_env: vec![("DISTLOCK_TOKEN", "7".to_string())],
///     remove_env: vec!["DISTLOCK_PERMIT"], // an inherited one is not this hold's
///     lock: None, // the file backend's `flock`ed descriptor: the supervisor keeps it open
///     grace: Duration::from_secs(10),
///     terminal: false,
///     terminal_on_demand: false,
/// };
/// let mut child = child::spawn(spec).await?;
/// let Event::Exited(status) = child.next_event().await? else { unreachable!() };
/// assert_eq!(child::exit_code(status), 7);
/// # assert!(matches!(child.next_event().await?, Event::TreeGone));
/// # Ok::<(), std::io::Error>(()) })
/// # }
/// ```
#[derive(Debug)]
pub struct Spec<'a> {
    /// The program (looked up in `PATH` when it has no `/`).
    pub program: &'a OsStr,
    /// Its arguments.
    pub args: &'a [OsString],
    /// Variables to set.
    pub set_env: Vec<(&'static str, String)>,
    /// Variables to remove (an inherited `DISTLOCK_TOKEN` must not pass for this hold's).
    pub remove_env: Vec<&'static str>,
    /// The lock's inheritable descriptor (file backend), held by the supervisor until the tree is gone.
    pub lock: Option<BorrowedFd<'a>>,
    /// How long descendants get between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Give the command the controlling terminal (distlock is in its foreground group).
    pub terminal: bool,
    /// Give it only once the command's group wants it (another process of distlock's group, a pager
    /// after it in a pipeline, reads it too).
    pub terminal_on_demand: bool,
}

/// What the supervisor reports.
///
/// The command's exit comes first, while the lock is still held; the lock may be released only once
/// the whole tree is gone:
///
/// ```
/// # fn main() -> std::io::Result<()> {
/// # // `spawn` starts this program again as `<program> __supervise …`: hand that to the supervisor,
/// # // as distlock's own `main` does.
/// # let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
/// # if argv.get(1).is_some_and(|a| a == distlock_cli::supervisor::SUBCOMMAND) {
/// #     std::process::exit(distlock_cli::supervisor::main(&argv[2..]));
/// # }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// use distlock_cli::child::{self, Event, Spec};
/// # let args: [std::ffi::OsString; 2] = ["-c".into(), "exit 3".into()];
/// # let spec = Spec { program: "sh".as_ref(), args: &args, set_env: vec![], remove_env: vec![],
/// #     lock: None, grace: std::time::Duration::from_secs(10), terminal: false,
/// #     terminal_on_demand: false };
///
/// let mut child = child::spawn(spec).await?; // sh -c 'exit 3'
/// let mut code = None;
/// loop {
///     match child.next_event().await? {
///         Event::Exited(status) => code = Some(child::exit_code(status)),
///         Event::TreeGone => break,
///         Event::Stopped(signo) => {
///             child::stop_self(signo); // Ctrl-Z: the job stops as a whole
///             child.resume();
///         }
///     }
/// }
/// assert_eq!(code, Some(3));
/// # Ok::<(), std::io::Error>(()) })
/// # }
/// ```
#[derive(Debug)]
pub enum Event {
    /// The command, which had the terminal, was stopped by this signal (Ctrl-Z); the terminal is
    /// distlock's group's again. Stop too, then [`Child::resume`].
    Stopped(i32),
    /// The command exited.
    Exited(ExitStatus),
    /// Every process the command started is gone (the supervisor has exited or is exiting).
    TreeGone,
}

/// A running command: the leader of its own process group, under a supervisor that is a child
/// subreaper.
///
/// ```
/// # fn main() -> std::io::Result<()> {
/// # // `spawn` starts this program again as `<program> __supervise …`: hand that to the supervisor,
/// # // as distlock's own `main` does.
/// # let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
/// # if argv.get(1).is_some_and(|a| a == distlock_cli::supervisor::SUBCOMMAND) {
/// #     std::process::exit(distlock_cli::supervisor::main(&argv[2..]));
/// # }
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// use distlock_cli::child::{self, Event, Spec};
/// # let args: [std::ffi::OsString; 2] = ["-c".into(), "sleep 60".into()];
/// # let spec = Spec { program: "sh".as_ref(), args: &args, set_env: vec![], remove_env: vec![],
/// #     lock: None, grace: std::time::Duration::from_secs(10), terminal: false,
/// #     terminal_on_demand: false };
///
/// let mut child = child::spawn(spec).await?; // sh -c 'sleep 60'
/// assert!(child.id() > 0); // its pid, also its process group's id
/// // The lock was lost (`--on-lost term`): SIGTERM to all it started, SIGKILL after the grace.
/// child.terminate_tree();
/// let Event::Exited(status) = child.next_event().await? else { unreachable!() };
/// assert_eq!(child::exit_code(status), 128 + 15); // killed by SIGTERM
/// assert!(matches!(child.next_event().await?, Event::TreeGone)); // now the lock may be released
/// # Ok::<(), std::io::Error>(()) })
/// # }
/// ```
#[derive(Debug)]
pub struct Child {
    supervisor: tokio::process::Child,
    reports: Lines<BufReader<OwnedReadHalf>>,
    requests: OwnedWriteHalf,
    pid: u32,
    exited: bool,
}

/// Starts the supervisor, which starts the command in its own process group. `Err` if the command
/// could not be started (`NotFound` when it does not exist).
///
/// Must be called inside a tokio runtime (the supervisor is reaped by it).
pub async fn spawn(spec: Spec<'_>) -> io::Result<Child> {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    let lock_fd: Option<RawFd> = spec.lock.map(|fd| fd.as_raw_fd());
    let invocation = Invocation {
        control: theirs.as_raw_fd(),
        lock: lock_fd,
        grace: spec.grace,
        terminal: spec.terminal,
        terminal_on_demand: spec.terminal_on_demand,
    };
    // Our own binary, even if it was replaced or deleted on disk since.
    let mut command = tokio::process::Command::new("/proc/self/exe");
    command
        .arg0("distlock")
        .arg(SUBCOMMAND)
        .args(invocation.to_args())
        .arg(spec.program)
        .args(spec.args)
        // Out of distlock's process group: a signal to that group (a terminal's Ctrl-C when the command
        // does not have the terminal) reaches distlock, which forwards it once.
        .process_group(0);
    for (key, value) in spec.set_env {
        command.env(key, value);
    }
    for key in spec.remove_env {
        command.env_remove(key);
    }
    let inherit: [RawFd; 2] = [theirs.as_raw_fd(), lock_fd.unwrap_or(-1)];
    // SAFETY: between fork and exec only fcntl (async-signal-safe): the two descriptors the supervisor
    // needs lose close-on-exec in the child only.
    unsafe {
        command.pre_exec(move || {
            for fd in inherit.into_iter().filter(|fd| *fd >= 0) {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    // If the supervisor dies before its job is done, what it leaves orphaned comes to us.
    crate::supervisor::become_subreaper()?;
    let mut supervisor = command.spawn()?;
    drop(theirs);
    ours.set_nonblocking(true)?;
    let (read, requests) = tokio::net::UnixStream::from_std(ours)?.into_split();
    let mut reports = BufReader::new(read).lines();
    let first = match reports.next_line().await {
        Ok(first) => first,
        Err(e) => {
            supervisor_failed(&mut supervisor).await;
            return Err(e);
        }
    };
    match first.as_deref().and_then(|l| l.split_once(' ')) {
        Some(("p", pid)) => Ok(Child {
            supervisor,
            reports,
            requests,
            pid: pid.parse().map_err(|_| bad_report(&first))?,
            exited: false,
        }),
        Some(("e", errno)) => {
            let _ = supervisor.wait().await;
            Err(io::Error::from_raw_os_error(
                errno.parse().map_err(|_| bad_report(&first))?,
            ))
        }
        _ => {
            supervisor_failed(&mut supervisor).await;
            Err(bad_report(&first))
        }
    }
}

/// The supervisor died (SIGKILLed, say) or misbehaved before reporting the tree gone: end it, then
/// kill and reap what it left orphaned (reparented to us, a subreaper), so the caller's release never
/// frees the lock under a live descendant. Off the runtime's thread, so renewals go on meanwhile.
async fn supervisor_failed(supervisor: &mut tokio::process::Child) {
    let _ = supervisor.start_kill();
    let _ = supervisor.wait().await;
    if let Err(e) = tokio::task::spawn_blocking(crate::supervisor::kill_orphans).await {
        tracing::warn!(error = %e, "killing what the supervisor left behind failed");
    }
}

fn bad_report(line: &Option<String>) -> io::Error {
    match line {
        None => io::Error::other("the supervisor exited before starting the command"),
        Some(line) => io::Error::other(format!("unexpected report from the supervisor: {line:?}")),
    }
}

impl Child {
    /// The command's pid (and process group id).
    pub fn id(&self) -> u32 {
        self.pid
    }

    fn request(&self, line: &str) {
        // A few bytes on a local socket nobody else writes to: they fit in its buffer.
        if let Err(e) = self.requests.try_write(format!("{line}\n").as_bytes()) {
            tracing::warn!(error = %e, "cannot reach the command's supervisor");
        }
    }

    /// Sends `signal` to the command's process group. A no-op once the command has exited: only an
    /// unreaped leader pins the group id (the supervisor checks that), so signalling later could hit a
    /// recycled one.
    pub fn signal_group(&self, signal: Signal) {
        if !self.exited {
            self.request(&format!("s {}", signal.as_raw()));
        }
    }

    /// SIGTERM to every process the command started, at any depth and in any group; SIGKILL to all of
    /// them after the grace.
    pub fn terminate_tree(&self) {
        self.request("t");
    }

    /// SIGKILL to every process the command started.
    pub fn kill_tree(&self) {
        self.request("k");
    }

    /// Continues the command after [`Event::Stopped`], giving it the terminal if distlock's group has
    /// it.
    pub fn resume(&self) {
        if !self.exited {
            self.request("c");
        }
    }

    /// The next report: the command's exit, then that its whole tree is gone.
    ///
    /// # Cancel safety
    /// Cancel safe (a line is consumed only when returned).
    pub async fn next_event(&mut self) -> io::Result<Event> {
        let line = match self.reports.next_line().await {
            Ok(line) => line,
            Err(e) => {
                supervisor_failed(&mut self.supervisor).await;
                return Err(e);
            }
        };
        match line.as_deref().and_then(|l| l.split_once(' ')) {
            Some(("z", signo)) => Ok(Event::Stopped(
                signo.parse().map_err(|_| bad_report(&line))?,
            )),
            Some(("x", raw)) => {
                let raw = raw.parse().map_err(|_| bad_report(&line))?;
                self.exited = true;
                Ok(Event::Exited(ExitStatus::from_raw(raw)))
            }
            _ if line.as_deref() == Some("d") => {
                // It exits right after saying so; on the file backend its copy of the lock's
                // descriptor closes with it.
                self.supervisor.wait().await?;
                Ok(Event::TreeGone)
            }
            _ => {
                supervisor_failed(&mut self.supervisor).await;
                Err(match line {
                    None => io::Error::other("the supervisor exited unexpectedly"),
                    line => bad_report(&line),
                })
            }
        }
    }
}

/// The exit code `distlock` passes on for a finished command: its own, or 128 + the signal that killed
/// it.
pub fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signo)) => crate::exit::signal_code(signo),
        // Not reachable for an exited child (stops are not reported by wait).
        (None, None) => crate::exit::Code::CannotExecute.as_i32(),
    }
}

/// Whether `signo` is ignored in this process (inherited so across exec).
fn is_ignored(signo: i32) -> bool {
    // SAFETY: sigaction with a null new action only reads the current one into a zeroed struct.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signo, std::ptr::null(), &mut current) == 0
            && current.sa_sigaction == libc::SIG_IGN
    }
}

/// Stops this process with `signo` (a job-control stop: SIGTSTP, SIGTTIN or SIGTTOU, at its default
/// action for the moment), as the command was, so that the shell sees the job stopped; returns once
/// continued.
pub fn stop_self(signo: i32) {
    let signo = match signo {
        libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU => signo,
        _ => libc::SIGSTOP,
    };
    // SAFETY: signal dispositions and kill on ourselves; nothing here handles these signals.
    unsafe {
        let previous = libc::signal(signo, libc::SIG_DFL);
        libc::kill(libc::getpid(), signo);
        if previous != libc::SIG_ERR {
            libc::signal(signo, previous);
        }
    }
}

/// A signal's short name, for messages.
pub fn signal_name(signo: i32) -> String {
    let name = match signo {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => return format!("signal {signo}"),
    };
    name.to_string()
}

/// SIGINT, SIGTERM, SIGHUP and SIGQUIT, caught from the moment they are installed so that each can be
/// passed on to the command exactly once (the command runs in its own process group, so a terminal's
/// Ctrl-C reaches only `distlock`, which forwards it).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use distlock_cli::child::Signals;
/// use rustix::process::{getpid, kill_process, Signal};
/// use std::time::Duration;
///
/// let mut signals = Signals::install()?; // before the command starts
/// kill_process(getpid(), Signal::TERM)?; // as systemd stopping the service would
/// // Caught, not fatal: `run` passes it on with `child.signal_group(signal)`.
/// let signal = tokio::time::timeout(Duration::from_secs(5), signals.recv()).await?;
/// assert_eq!(signal, Signal::TERM);
/// assert_eq!(signals.pending().await, None); // each signal is taken once
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Signals {
    /// `None` for a signal ignored when distlock started (`nohup`, a shell's `trap ''`): it stays
    /// ignored, here and for the command.
    int: Option<tokio::signal::unix::Signal>,
    term: Option<tokio::signal::unix::Signal>,
    hup: Option<tokio::signal::unix::Signal>,
    quit: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    /// Installs the handlers. From here on these signals no longer end `distlock` by themselves.
    pub fn install() -> io::Result<Self> {
        let catch = |kind: SignalKind| -> io::Result<Option<tokio::signal::unix::Signal>> {
            if is_ignored(kind.as_raw_value()) {
                return Ok(None);
            }
            signal(kind).map(Some)
        };
        Ok(Self {
            int: catch(SignalKind::interrupt())?,
            term: catch(SignalKind::terminate())?,
            hup: catch(SignalKind::hangup())?,
            quit: catch(SignalKind::quit())?,
        })
    }

    /// The next signal received.
    ///
    /// # Cancel safety
    /// Cancel safe: a signal is consumed only when returned.
    pub async fn recv(&mut self) -> Signal {
        async fn next(signal: &mut Option<tokio::signal::unix::Signal>) -> Option<()> {
            match signal {
                Some(signal) => signal.recv().await,
                None => std::future::pending().await,
            }
        }
        let got = tokio::select! {
            got = next(&mut self.int) => got.map(|()| Signal::INT),
            got = next(&mut self.term) => got.map(|()| Signal::TERM),
            got = next(&mut self.hup) => got.map(|()| Signal::HUP),
            got = next(&mut self.quit) => got.map(|()| Signal::QUIT),
        };
        match got {
            Some(signal) => signal,
            // A stream ended (the runtime is shutting down): nothing more will come.
            None => std::future::pending().await,
        }
    }

    /// A signal already received and not yet taken, if any.
    pub async fn pending(&mut self) -> Option<Signal> {
        tokio::select! {
            biased;
            signal = self.recv() => Some(signal),
            () = std::future::ready(()) => None,
        }
    }
}
