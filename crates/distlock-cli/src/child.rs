//! Spawning the command so it never outlives its holder, signalling its process group, and the
//! signals `distlock` forwards.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::mpsc;
use std::sync::Mutex;

use rustix::process::{Pid, Signal};
use tokio::signal::unix::{signal, SignalKind};

/// What the child is started with.
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
}

/// A running command: the leader of its own process group.
#[derive(Debug)]
pub struct Child {
    inner: tokio::process::Child,
}

type Job = Box<dyn FnOnce() + Send>;

/// Runs `job` on the spawner thread.
///
/// Linux delivers the parent-death signal when the *thread* that forked exits, not the process. Tokio's
/// blocking-pool threads come and go, so children are forked from one thread that is started once and
/// never returns: the signal then fires exactly when the process dies.
fn on_spawner_thread(job: Job) -> io::Result<()> {
    static SPAWNER: Mutex<Option<mpsc::Sender<Job>>> = Mutex::new(None);
    let mut spawner = SPAWNER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if spawner.is_none() {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("distlock-spawner".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    // A panicking job must not end this thread (and with it every child it forked);
                    // its reply channel drops, which the caller reports.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
                // Unreachable while the sender lives in the static; never exit regardless, as an exiting
                // thread would kill every child it forked.
                loop {
                    std::thread::park();
                }
            })?;
        *spawner = Some(tx);
    }
    match spawner.as_ref() {
        Some(sender) => sender
            .send(job)
            .map_err(|_| io::Error::other("the spawner thread is gone")),
        None => Err(io::Error::other("the spawner thread could not be started")),
    }
}

/// Starts the command in its own process group, with SIGKILL as its parent-death signal.
///
/// Must be called inside a tokio runtime (the child is reaped by it).
pub async fn spawn(spec: Spec<'_>) -> io::Result<Child> {
    let runtime = tokio::runtime::Handle::current();
    let parent = rustix::process::getpid();
    let mut command = tokio::process::Command::new(spec.program);
    command.args(spec.args).process_group(0);
    for (key, value) in spec.set_env {
        command.env(key, value);
    }
    for key in spec.remove_env {
        command.env_remove(key);
    }
    // SAFETY: the closure runs between fork and exec and only makes two system calls (prctl,
    // getppid); it neither allocates nor takes locks.
    unsafe {
        command.pre_exec(move || die_with_parent(parent));
    }
    let (reply, result) = tokio::sync::oneshot::channel();
    on_spawner_thread(Box::new(move || {
        // tokio::process registers the child with this runtime's reaper.
        let _entered = runtime.enter();
        let _ = reply.send(command.spawn());
    }))?;
    let inner = result
        .await
        .map_err(|_| io::Error::other("the spawner thread dropped the request"))??;
    Ok(Child { inner })
}

/// In the forked child: ask for SIGKILL when the parent (thread) dies, then check the parent is still
/// the one that forked us. If it died before the prctl, the signal will never come, so refuse to exec
/// rather than run orphaned.
fn die_with_parent(parent: Pid) -> io::Result<()> {
    rustix::process::set_parent_process_death_signal(Some(Signal::KILL))
        .map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))?;
    if rustix::process::getppid() != Some(parent) {
        return Err(io::Error::from_raw_os_error(
            rustix::io::Errno::SRCH.raw_os_error(),
        ));
    }
    Ok(())
}

impl Child {
    /// The child's pid (and process group id) until it has been reaped.
    pub fn id(&self) -> Option<u32> {
        self.inner.id()
    }

    /// Sends `signal` to the child's process group. A no-op once the child has been reaped: only an
    /// unreaped leader pins the group id, so signalling later could hit a recycled one.
    pub fn signal_group(&self, signal: Signal) {
        let Some(pid) = self.inner.id().and_then(|id| Pid::from_raw(id as i32)) else {
            return;
        };
        match rustix::process::kill_process_group(pid, signal) {
            Ok(()) => {}
            // The group emptied out between the check and the kill.
            Err(rustix::io::Errno::SRCH) => {}
            Err(e) => {
                tracing::warn!(pid = pid.as_raw_nonzero().get(), error = %e, "could not signal the command")
            }
        }
    }

    /// Waits for the child to exit.
    ///
    /// # Cancel safety
    /// Cancel safe (tokio's `Child::wait` is).
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        self.inner.wait().await
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
#[derive(Debug)]
pub struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers. From here on these signals no longer end `distlock` by themselves.
    pub fn install() -> io::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
        })
    }

    /// The next signal received.
    ///
    /// # Cancel safety
    /// Cancel safe: a signal is consumed only when returned.
    pub async fn recv(&mut self) -> Signal {
        let got = tokio::select! {
            got = self.int.recv() => got.map(|()| Signal::INT),
            got = self.term.recv() => got.map(|()| Signal::TERM),
            got = self.hup.recv() => got.map(|()| Signal::HUP),
            got = self.quit.recv() => got.map(|()| Signal::QUIT),
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
