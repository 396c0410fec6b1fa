//! Child processes that die with their parent, for the `distlock run` supervisor (the command it
//! starts) and the testkit (the servers a test starts).
//!
//! Linux's parent-death signal (`PR_SET_PDEATHSIG`) is tied to the *thread* that forked, not the
//! process, and is cleared by a `uid`/`gid` switch. So:
//!
//! * [`die_with_parent`] sets it in `pre_exec`, which std runs after those switches, and fails the
//!   spawn (the child exits) if the parent is already gone by then, when no signal would come.
//! * [`spawn_on_spawner_thread`] forks from one thread that lives as long as the process, for callers
//!   on short-lived threads (test threads): the signal then fires when the *process* dies. A caller
//!   whose forking thread lives as long as its process (the supervisor is single-threaded) does not
//!   need it.

use std::io;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command};
use std::sync::{mpsc, OnceLock};

use rustix::process::Signal;

/// Makes the child started by `command` get SIGKILL when the thread that forks it dies, and refuse
/// to start (`ESRCH`) if that parent died before this took effect.
///
/// Registered as a `pre_exec` hook: hooks run in the order they were added, so add this one last if
/// other hooks must run first.
pub fn die_with_parent(command: &mut Command) {
    let parent = rustix::process::getpid();
    // SAFETY: the closure runs in the forked child before exec and only makes raw syscalls (prctl,
    // getppid) and builds an io::Error from an errno, which does not allocate.
    unsafe {
        command.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))
                .map_err(io::Error::from)?;
            // The parent may have died between fork and prctl; then nobody would kill us.
            if rustix::process::getppid() != Some(parent) {
                return Err(io::Error::from_raw_os_error(
                    rustix::io::Errno::SRCH.raw_os_error(),
                ));
            }
            Ok(())
        });
    }
}

type SpawnJob = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawns `command` from the process-lifetime spawner thread, so that a parent-death signal
/// ([`die_with_parent`]) fires when this *process* dies rather than when the (short-lived) calling
/// thread ends.
pub fn spawn_on_spawner_thread(command: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<io::Result<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("distlock-spawner".to_owned())
            .spawn(move || {
                // Never returns while the process lives: the sender sits in a static.
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .map(|_| tx)
    });
    let tx = spawner
        .as_ref()
        .map_err(|e| io::Error::new(e.kind(), format!("starting the spawner thread: {e}")))?;
    let gone = || io::Error::other("the spawner thread is gone");
    let (reply_tx, reply_rx) = mpsc::channel();
    tx.send((command, reply_tx)).map_err(|_| gone())?;
    reply_rx.recv().map_err(|_| gone())?
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// The child of a thread that ends is killed; the spawner thread's child outlives the caller's
    /// thread.
    #[test]
    fn children_die_with_the_forking_thread_unless_it_is_the_spawner() {
        let spawn = |on_spawner: bool| {
            std::thread::spawn(move || {
                let mut command = Command::new("sleep");
                command.arg("30");
                die_with_parent(&mut command);
                if on_spawner {
                    spawn_on_spawner_thread(command)
                } else {
                    command.spawn()
                }
            })
            .join()
            .expect("thread")
            .expect("spawn sleep")
        };
        let mut orphaned = spawn(false);
        let mut kept = spawn(true);
        let status = orphaned.wait().expect("wait");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(Signal::KILL.as_raw())
        );
        assert!(kept.try_wait().expect("try_wait").is_none(), "killed early");
        kept.kill().expect("kill");
        kept.wait().expect("wait");
    }
}
