//! A lock holder in another process: the real `distlock` binary running `sh` under the lock. Used by the
//! conformance suite to kill a holder process and watch the lock free.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Where the `distlock` binary is: `$DISTLOCK_BIN`, else beside the running test binary's directory
/// (`target/<profile>/distlock`, which `cargo nextest run --workspace` builds).
pub fn distlock_bin() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("DISTLOCK_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("finding the test binary", e))?;
    let mut dir = exe.parent().map(Path::to_path_buf);
    while let Some(d) = dir {
        let candidate = d.join("distlock");
        if candidate.is_file() {
            return Ok(candidate);
        }
        dir = d.parent().map(Path::to_path_buf);
        if dir
            .as_ref()
            .is_some_and(|p| p.file_name().is_some_and(|n| n == "target"))
        {
            break;
        }
    }
    Err(Error::MissingBinary {
        program: "distlock".into(),
        hint:
            "build it with `cargo build -p distlock-cli` (scripts/test.sh does) or set DISTLOCK_BIN"
                .into(),
    })
}

/// A `distlock run --url URL --lease L NAME -- sh …` process holding a lock.
#[derive(Debug)]
pub struct HolderProcess {
    process: Child,
    dir: tempfile::TempDir,
    token: Option<u64>,
    child_pid: u32,
}

impl HolderProcess {
    /// Starts the holder and waits (30 s at most) until its command runs under the lock.
    pub fn spawn(url: &str, name: &str, lease: Duration) -> Result<Self> {
        Self::spawn_with(url, name, lease, &[])
    }

    /// [`spawn`](Self::spawn) with more `distlock run` flags before the name (`--permits 2`,
    /// `--read`).
    pub fn spawn_with(url: &str, name: &str, lease: Duration, flags: &[&str]) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("distlock-holder-")
            .tempdir()
            .map_err(|e| Error::io("creating the holder's temp dir", e))?;
        let script = "echo \"${DISTLOCK_TOKEN:-none}\" > \"$1/token.tmp\"; echo $$ > \"$1/pid\"; mv \"$1/token.tmp\" \"$1/token\"; exec sleep 3600";
        let lease_ms = format!("{}ms", lease.as_millis());
        let process = Command::new(distlock_bin()?)
            .args(["run", "--url", url, "--lease", &lease_ms])
            .args(flags)
            .args([name, "--", "sh", "-c", script, "holder"])
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Error::io("spawning distlock run", e))?;
        let mut holder = Self {
            process,
            dir,
            token: None,
            child_pid: 0,
        };
        let started = Instant::now();
        let token_file = holder.dir.path().join("token");
        while !token_file.exists() {
            if let Ok(Some(status)) = holder.process.try_wait() {
                return Err(Error::State(format!(
                    "distlock run exited with {status} before holding the lock"
                )));
            }
            if started.elapsed() > Duration::from_secs(30) {
                return Err(Error::Timeout {
                    what: "distlock run holding the lock".into(),
                    after: Duration::from_secs(30),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let read =
            |file: &str| std::fs::read_to_string(holder.dir.path().join(file)).unwrap_or_default();
        holder.token = read("token").trim().parse().ok();
        holder.child_pid = read("pid").trim().parse().unwrap_or(0);
        Ok(holder)
    }

    /// The `DISTLOCK_TOKEN` the holder's command saw, if the backend mints tokens.
    pub fn token(&self) -> Option<u64> {
        self.token
    }

    /// The pid of the `distlock` process.
    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// SIGKILLs the `distlock` process (its command dies with it by the parent-death signal).
    pub fn kill9(&mut self) -> Result<()> {
        self.process
            .kill()
            .map_err(|e| Error::io("killing the holder", e))?;
        self.process
            .wait()
            .map_err(|e| Error::io("waiting for the holder", e))?;
        Ok(())
    }

    /// Whether the holder's command is gone, polling up to `within`.
    pub fn child_gone(&self, within: Duration) -> bool {
        let started = Instant::now();
        loop {
            if self.child_pid == 0 || !crate::sweep::is_alive(self.child_pid) {
                return true;
            }
            if started.elapsed() > within {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for HolderProcess {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        if self.child_pid != 0 {
            if let Some(pid) = rustix::process::Pid::from_raw(self.child_pid as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
    }
}
