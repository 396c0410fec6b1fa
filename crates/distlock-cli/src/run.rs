//! `distlock run`: acquire, run the command while held, react to loss and signals, release.

use std::ffi::OsStr;
use std::future::Future;
use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use distlock::{Lock, LockGuard, LockOptions, LockState};
use rustix::process::Signal;

use crate::child::{self, Child, Event, Signals, Spec};
use crate::cli::{self, OnLost, RunArgs};
use crate::exit::{self, Code, Failure};

/// Runs `distlock run`; `Ok` is the exit code to use.
pub async fn run(args: RunArgs) -> Result<i32, Failure> {
    // Everything the user typed is checked before any lock is touched.
    if let Some(lease) = args.lease {
        LockOptions::default()
            .with_lease(lease)
            .validate()
            .map_err(|e| Failure::new(Code::Usage, format!("invalid --lease: {}", e.message())))?;
    }
    distlock_core::name::validate(&args.name)?;
    let Some((program, program_args)) = args.command.split_first() else {
        return Err(Failure::new(
            Code::Usage,
            "no command given: distlock run NAME -- CMD [ARGS…]",
        ));
    };
    precheck_command(program)?;
    let wait = if args.no_wait {
        Some(Duration::ZERO)
    } else {
        args.wait
    };
    let mut url = cli::lock_url(args.url.as_deref())?;
    if args.fair {
        url = cli::fair_url(&url)?;
    }

    // Caught from here on, so a signal during the wait ends it cleanly and one during the run is
    // forwarded rather than killing distlock and orphaning the command's hold.
    let mut signals = Signals::install().map_err(|e| {
        Failure::new(
            Code::Unavailable,
            format!("cannot install signal handlers: {e}"),
        )
    })?;

    let locks = match or_signal(&mut signals, distlock::connect(&url)).await {
        Ok(connected) => connected?,
        Err(signal) => return Ok(exit::signal_code(signal.as_raw())),
    };
    let outcome = hold(&locks, &args, program, program_args, wait, &mut signals).await;
    // Let the undo of an interrupted acquire or a handed-off release reach the server, so nothing is
    // left to expire by lease; bounded, since the server may be the reason we are leaving.
    let _ = tokio::time::timeout(CLOSE_LIMIT, locks.close()).await;
    outcome
}

/// How long `distlock` waits at exit for background releases and undos.
const CLOSE_LIMIT: Duration = Duration::from_secs(5);

/// Acquires, runs the command while held, releases; `Ok` is the exit code to use.
async fn hold(
    locks: &distlock::Locks,
    args: &RunArgs,
    program: &std::ffi::OsString,
    program_args: &[std::ffi::OsString],
    wait: Option<Duration>,
    signals: &mut Signals,
) -> Result<i32, Failure> {
    let handle = LockHandle::new(locks, args)?;
    let lock = handle.lock();
    let waiting =
        crate::progress::while_waiting(locks, &args.name, acquire(lock, wait, args.lease));
    let guard = match or_signal(signals, waiting).await {
        Ok(Ok(Some(guard))) => guard,
        Ok(Ok(None)) => {
            let flag = if args.no_wait {
                "--no-wait"
            } else {
                "--wait 0"
            };
            return Err(Failure::new(
                Code::Busy,
                format!("lock {:?}: held elsewhere ({flag})", args.name),
            ));
        }
        Ok(Err(e)) => return Err(kind_failure(e, args)),
        // Dropping the acquire is cancel safe: nothing is left queued or held.
        Err(signal) => return Ok(exit::signal_code(signal.as_raw())),
    };

    // A signal that came while acquiring or a loss since: do not start the command at all.
    if let Some(signal) = signals.pending().await {
        release(guard, signals).await;
        return Ok(exit::signal_code(signal.as_raw()));
    }
    if guard.state() == LockState::Lost {
        report_loss(&guard, "the command was not started");
        release(guard, signals).await;
        return Ok(Code::Lost.as_i32());
    }

    let mut set_env = vec![("DISTLOCK_NAME", args.name.clone())];
    let mut remove_env = Vec::new();
    match guard.token() {
        Some(token) => set_env.push(("DISTLOCK_TOKEN", token.to_string())),
        // An inherited token (from an outer `distlock run`) must not pass for this hold's.
        None => remove_env.push("DISTLOCK_TOKEN"),
    }
    match guard.permit() {
        Some(permit) => set_env.push(("DISTLOCK_PERMIT", permit.to_string())),
        None => remove_env.push("DISTLOCK_PERMIT"),
    }
    let terminal = terminal();
    let spec = Spec {
        program,
        args: program_args,
        set_env,
        remove_env,
        lock: guard.inheritable_descriptor(),
        grace: args.grace,
        terminal: terminal == Terminal::HandOver,
        terminal_on_demand: terminal == Terminal::OnDemand,
    };
    let mut child = match child::spawn(spec).await {
        Ok(child) => child,
        Err(e) => {
            release(guard, signals).await;
            let code = match e.kind() {
                std::io::ErrorKind::NotFound => Code::NotFound,
                _ => Code::CannotExecute,
            };
            return Err(Failure::new(
                code,
                format!("cannot run {}: {e}", quoted(program)),
            ));
        }
    };

    let outcome = supervise(&mut child, &guard, signals, args.on_lost, args.grace).await;
    let lost_while_running = outcome.lost || guard.state() == LockState::Lost;
    if lost_while_running && !outcome.lost {
        // Lost at the moment the command ended: it cannot be said to have finished while held.
        report_loss(&guard, "the command had just finished");
    }
    let released = or_signal(signals, guard.release()).await;

    let status = match outcome.status {
        Ok(status) => status,
        Err(e) => {
            return Err(Failure::new(
                Code::Unavailable,
                format!("lost track of the command (pid {}): {e}", outcome.pid),
            ))
        }
    };
    if lost_while_running {
        return Ok(Code::Lost.as_i32());
    }
    let released = match released {
        Ok(released) => released,
        // Interrupted: the lock frees with the process or its lease; the command did finish.
        Err(_) => Ok(()),
    };
    Ok(code_after_release(child::exit_code(status), &released))
}

/// The exit code once the command finished while held and the release was tried: 76 only for a
/// definite `NotHeld` (the lock slipped away without the guard noticing, so the command did not run
/// entirely under it); any other failure (an unreachable server, an ambiguous outcome after retries)
/// leaves the command's own code, with one line saying the lock frees when its lease ends.
fn code_after_release(command_code: i32, released: &distlock::Result<()>) -> i32 {
    match released {
        Err(e) if e.kind() == distlock::ErrorKind::NotHeld => {
            exit::report(e);
            Code::Lost.as_i32()
        }
        Err(e) => {
            exit::report(format_args!(
                "{e} (the command had finished; the lock frees when its lease ends)"
            ));
            command_code
        }
        Ok(()) => command_code,
    }
}

/// What `run` holds: NAME's mutex, a side of its read-write lock, or one of its semaphore's permits.
enum LockHandle {
    Mutex(Lock),
    Read(distlock::RwLock),
    Write(distlock::RwLock),
    Permit(Lock),
}

impl LockHandle {
    /// The handle `--read`, `--write` or `--permits` asks for. A backend without that kind is a usage
    /// error (64), named with the kinds it has.
    fn new(locks: &distlock::Locks, args: &RunArgs) -> Result<Self, Failure> {
        let made = if args.read {
            locks.read_write(&args.name).map(LockHandle::Read)
        } else if args.write {
            locks.read_write(&args.name).map(LockHandle::Write)
        } else if let Some(permits) = args.permits {
            locks
                .semaphore(&args.name, permits)
                .map(|semaphore| LockHandle::Permit(semaphore.permit()))
        } else {
            locks.lock(&args.name).map(LockHandle::Mutex)
        };
        made.map_err(|e| kind_failure(e, args))
    }

    fn lock(&self) -> &Lock {
        match self {
            LockHandle::Mutex(lock) | LockHandle::Permit(lock) => lock,
            LockHandle::Read(rw) => rw.reader(),
            LockHandle::Write(rw) => rw.writer(),
        }
    }
}

/// A library error, with the kind-related ones as usage errors (64): a kind the engine lacks, another
/// number of permits than the one stored, a name in use as another kind. The command is not run.
fn kind_failure(error: distlock::Error, args: &RunArgs) -> Failure {
    use distlock::ErrorKind;
    let asked_for_kind = args.read || args.write || args.permits.is_some();
    match error.kind() {
        ErrorKind::Unsupported if asked_for_kind => Failure::new(Code::Usage, error.to_string()),
        ErrorKind::LimitMismatch { stored, requested } => Failure::new(
            Code::Usage,
            format!(
                "lock {:?}: the semaphore has {stored} permits, not {requested} (--permits {requested}); every user must give the same number ({})",
                args.name,
                error.message()
            ),
        ),
        ErrorKind::KindConflict => Failure::new(Code::Usage, error.to_string()),
        _ => error.into(),
    }
}

/// Acquires as asked: one attempt for a zero wait (`None` when busy), else waits (a limit elapsing is
/// `ErrorKind::Timeout`).
async fn acquire(
    lock: &Lock,
    wait: Option<Duration>,
    lease: Option<Duration>,
) -> distlock::Result<Option<LockGuard>> {
    // Without --lease, the connection's default: the URL's `?lease=`, else the engine's.
    let mut options = lock.options();
    if let Some(lease) = lease {
        options = options.lease(lease);
    }
    match wait {
        Some(limit) if limit.is_zero() => options.try_acquire().await,
        Some(limit) => options.wait(limit).acquire().await.map(Some),
        None => options.wait_forever().acquire().await.map(Some),
    }
}

/// How the command's run ended.
struct Outcome {
    status: std::io::Result<std::process::ExitStatus>,
    pid: u32,
    /// The lock was lost while the command (or what it left behind) ran.
    lost: bool,
}

/// Waits for the command and then for every process it started to be gone, forwarding signals to its
/// process group and acting on loss. Returns only once the supervisor reported the whole tree gone (or
/// itself died), so the caller's release never frees the lock under a live descendant.
async fn supervise(
    child: &mut Child,
    guard: &LockGuard,
    signals: &mut Signals,
    on_lost: OnLost,
    grace: Duration,
) -> Outcome {
    let pid = child.id();
    let lost = guard.lost();
    tokio::pin!(lost);
    let mut was_lost = false;
    let mut status = None;
    loop {
        tokio::select! {
            event = child.next_event() => match event {
                Ok(Event::Stopped(signo)) => {
                    child::stop_self(signo);
                    // Continued. A loss while stopped is acted on by the next turn (SIGTERM comes with
                    // SIGCONT); the command is not let loose without the lock first.
                    if on_lost == OnLost::Ignore || guard.state() != LockState::Lost {
                        child.resume();
                    }
                }
                Ok(Event::Exited(exited)) => status = Some(Ok(exited)),
                Ok(Event::TreeGone) => break,
                Err(e) => {
                    // The supervisor is gone: the command died with it (parent-death signal), and
                    // what else it left was killed by `next_event` before returning this.
                    status = Some(status.unwrap_or(Err(e)));
                    break;
                }
            },
            signal = signals.recv() => {
                if status.is_none() {
                    // The command has its own process group, so this is the only copy it gets.
                    tracing::debug!(signal = signal.as_raw(), "forwarding a signal to the command");
                    child.signal_group(signal);
                } else {
                    // The command is done; what it left behind is being stopped: hurry that up.
                    child.kill_tree();
                }
            }
            () = &mut lost, if !was_lost => {
                was_lost = true;
                let action = match on_lost {
                    OnLost::Term => {
                        child.terminate_tree();
                        format!(
                            "sent SIGTERM to the command and everything it started, SIGKILL in {} to whatever is still running",
                            distlock_core::duration::format(grace)
                        )
                    }
                    OnLost::Kill => {
                        child.kill_tree();
                        "sent SIGKILL to the command and everything it started".to_string()
                    }
                    OnLost::Ignore => "letting the command finish (--on-lost ignore); exit code will be 76".to_string(),
                };
                report_loss(guard, &action);
            }
        }
    }
    Outcome {
        status: status
            .unwrap_or_else(|| Err(std::io::Error::other("the supervisor exited unexpectedly"))),
        pid,
        lost: was_lost,
    }
}

/// What the command gets of the controlling terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Terminal {
    /// Nothing: distlock is not in its foreground (or has none).
    None,
    /// The terminal, at once: distlock owns it alone.
    HandOver,
    /// The terminal once the command's group is stopped for want of it: another process of
    /// distlock's group (a pager after it in a pipeline) reads it too.
    OnDemand,
}

/// Whether `distlock` owns its controlling terminal: our process group is its foreground group (stdin
/// need not be the terminal: in a pipeline the command may still read `/dev/tty`); and whether it
/// shares it with another process of its group.
fn terminal() -> Terminal {
    use std::os::fd::AsRawFd;
    let Some(tty) = crate::supervisor::open_tty() else {
        return Terminal::None;
    };
    // SAFETY: plain system calls on an open descriptor and ourselves.
    if unsafe { libc::tcgetpgrp(tty.as_raw_fd()) != libc::getpgrp() } {
        Terminal::None
    } else if crate::supervisor::alone_in_process_group() {
        Terminal::HandOver
    } else {
        Terminal::OnDemand
    }
}

/// The one line saying the lock was lost, why, and what was done about it.
fn report_loss(guard: &LockGuard, action: &str) {
    let reason = guard
        .loss_reason()
        .unwrap_or_else(|| "no reason recorded".to_string());
    exit::report(format_args!(
        "lock {:?} lost: {reason}; {action}",
        guard.name()
    ));
}

/// Releases, giving up early on a signal (the lock then frees when the process or its lease ends).
/// Used where the exit code is already decided.
async fn release(guard: LockGuard, signals: &mut Signals) {
    if let Ok(Err(e)) = or_signal(signals, guard.release()).await {
        tracing::debug!(error = %e, "release failed");
    }
}

/// Runs `fut` unless one of the forwarded signals arrives first.
async fn or_signal<F: Future>(signals: &mut Signals, fut: F) -> Result<F::Output, Signal> {
    tokio::select! {
        out = fut => Ok(out),
        signal = signals.recv() => Err(signal),
    }
}

/// Fails with 127 before anything is locked when the command plainly does not exist (no such path, or
/// in no `PATH` directory); whatever else can go wrong is found out at exec time.
fn precheck_command(program: &OsStr) -> Result<(), Failure> {
    let not_found = |why: &str| {
        Failure::new(
            Code::NotFound,
            format!("cannot run {}: {why}", quoted(program)),
        )
    };
    if program.is_empty() {
        return Err(not_found("the command is empty"));
    }
    if program.as_bytes().contains(&b'/') {
        return match std::fs::symlink_metadata(program) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(not_found("no such file")),
            _ => Ok(()),
        };
    }
    // With no PATH the C library falls back to a default search path: leave it to exec.
    let Some(path) = std::env::var_os("PATH").filter(|p| !p.is_empty()) else {
        return Ok(());
    };
    let found = std::env::split_paths(&path).any(|dir| {
        let dir = if dir.as_os_str().is_empty() {
            std::path::PathBuf::from(".")
        } else {
            dir
        };
        dir.join(program).symlink_metadata().is_ok()
    });
    if found {
        Ok(())
    } else {
        Err(not_found("command not found in PATH"))
    }
}

fn quoted(program: &OsStr) -> String {
    format!("{:?}", program.to_string_lossy())
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock::{Error, ErrorKind};

    #[test]
    fn only_a_definite_not_held_release_overrides_the_commands_code() {
        assert_eq!(code_after_release(3, &Ok(())), 3);
        let not_held = Err(Error::new(ErrorKind::NotHeld, "gone"));
        assert_eq!(code_after_release(3, &not_held), Code::Lost.as_i32());
        // An ambiguous or failed release (the Redis backend reports a retried release it could not
        // confirm as Unavailable) is not a loss during the run.
        for kind in [
            ErrorKind::Unavailable,
            ErrorKind::Timeout,
            ErrorKind::Protocol,
        ] {
            assert_eq!(
                code_after_release(3, &Err(Error::new(kind, "unsure"))),
                3,
                "{kind:?}"
            );
        }
    }
}
