//! `distlock run` driven as a user would: the real binary started on a lock with a shell command
//! (`HOLD_SCRIPT`), signalled, waited for; its stderr kept in a temp dir for failure messages. Shared by
//! the backends' CLI and fault tests. Panics with the reason on a failure (test support).
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};

/// The shell script of a holder's command: records `$DISTLOCK_TOKEN` and its pid in `$1`, traps SIGTERM
/// (writes `$1/term`, exits 143), and otherwise runs until signalled.
pub const HOLD_SCRIPT: &str = r#"D=$1
trap 'echo term > "$D/term"; exit 143' TERM
echo "${DISTLOCK_TOKEN:-none}" > "$D/token.tmp"; echo $$ > "$D/pid"; mv "$D/token.tmp" "$D/token"
while :; do sleep 0.1; done"#;

/// A `distlock run` process, its stderr in a file of its temp dir.
#[derive(Debug)]
pub struct Run {
    pub child: Child,
    pub dir: tempfile::TempDir,
    status: Option<ExitStatus>,
}

impl Run {
    /// `distlock run --url URL --lease LEASE [extra…] NAME -- sh -c SCRIPT run <dir>`.
    pub fn spawn(url: &str, lease: &str, extra: &[&str], name: &str, script: &str) -> Run {
        let dir = tempfile::Builder::new()
            .prefix("distlock-run-")
            .tempdir()
            .expect("temp dir");
        let stderr = std::fs::File::create(dir.path().join("stderr")).expect("stderr file");
        let bin = crate::holder::distlock_bin().expect("the distlock binary");
        let child = Command::new(bin)
            .args(["run", "--url", url, "--lease", lease])
            .args(extra)
            .args([name, "--", "sh", "-c", script, "run"])
            .arg(dir.path())
            .env_remove("DISTLOCK_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .spawn()
            .expect("spawning distlock run");
        Run {
            child,
            dir,
            status: None,
        }
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    pub fn read(&self, file: &str) -> Option<String> {
        std::fs::read_to_string(self.path(file))
            .ok()
            .map(|s| s.trim().to_string())
    }

    pub fn stderr(&self) -> String {
        self.read("stderr").unwrap_or_default()
    }

    pub fn pid(&self) -> Pid {
        Pid::from_child(&self.child)
    }

    pub fn signal(&self, signal: Signal) {
        kill_process(self.pid(), signal).expect("signalling distlock");
    }

    /// The exit status if it has exited (reaping it).
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("try_wait");
        }
        self.status
    }

    /// Waits up to `within` for the exit; `None` if still running.
    pub fn wait_for_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.try_status() {
                return Some(status);
            }
            if started.elapsed() >= within {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (30 s at most) until the command wrote its token file; panics if distlock exits first.
    pub fn wait_started(&mut self) -> (u64, u32) {
        let started = Instant::now();
        while !self.path("token").exists() {
            if let Some(status) = self.try_status() {
                panic!(
                    "distlock run exited with {status} before its command ran: {}",
                    self.stderr()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "distlock run did not start its command: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let token = self
            .read("token")
            .unwrap()
            .parse()
            .expect("a numeric token");
        let pid = self.read("pid").unwrap().parse().expect("a pid");
        (token, pid)
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if self.try_status().is_none() {
            // Our own child, by pid: resume (if stopped) and kill it.
            let _ = kill_process(self.pid(), Signal::CONT);
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A child process of a test (a `distlock run`, a `psql`, a holder script), resumed if stopped and
/// SIGKILLed if the test ends with it still running: a failed assertion leaves nothing behind.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
}

impl ChildGuard {
    pub fn spawn(command: &mut Command) -> ChildGuard {
        ChildGuard {
            child: Some(command.spawn().expect("spawning a child")),
        }
    }

    /// Waits for the exit (reaping the child); `None` if it is still running after `limit`.
    pub fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut().expect("not yet waited for");
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return Some(status);
            }
            if started.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("still running").id()
    }

    /// SIGKILL (this child only) and reap it.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("still running");
        child.kill().expect("SIGKILL");
        child.wait().expect("reaping");
    }

    /// If still running: resumed (if stopped), SIGKILLed and reaped. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = kill_process(Pid::from_child(&child), Signal::CONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `distlock run --url URL --no-wait NAME -- true` to completion: its exit code.
pub fn no_wait_run(url: &str, name: &str) -> i32 {
    let bin = crate::holder::distlock_bin().expect("the distlock binary");
    Command::new(bin)
        .args(["run", "--url", url, "--no-wait", name, "--", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("distlock run --no-wait")
        .code()
        .expect("an exit code")
}
