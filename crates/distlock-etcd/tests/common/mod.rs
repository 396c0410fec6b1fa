//! Helpers shared by the etcd test binaries that run the real `distlock` binary and `etcdctl`.
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};

/// A unique lock name for one test case.
pub fn name(case: &str) -> String {
    format!(
        "etcd-test/{case}/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// One key under a prefix as `etcdctl get --prefix P -w fields` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFields {
    pub key: String,
    pub create_revision: u64,
    /// The lease the key hangs on (decimal, as etcdctl prints it).
    pub lease: i64,
}

/// Every key under `prefix`, as etcdctl sees it (`-w fields`: one `"Field" : value` line per field),
/// oldest first (the holder, then the waiters in queue order).
pub fn keys(endpoints: &str, prefix: &str) -> Vec<KeyFields> {
    let out =
        distlock_testkit::etcd::etcdctl(endpoints, &["get", "--prefix", prefix, "-w", "fields"])
            .expect("etcdctl get");
    let mut keys: Vec<KeyFields> = Vec::new();
    for line in out.lines() {
        let Some((field, value)) = line.split_once(" : ") else {
            continue;
        };
        let value = value.trim().trim_matches('"');
        match field.trim_matches('"') {
            "Key" => keys.push(KeyFields {
                key: value.to_string(),
                create_revision: 0,
                lease: 0,
            }),
            "CreateRevision" => {
                keys.last_mut().expect("Key first").create_revision = value.parse().unwrap()
            }
            "Lease" => keys.last_mut().expect("Key first").lease = value.parse().unwrap(),
            _ => {}
        }
    }
    // etcdctl lists keys in key order; the queue order is creation order.
    keys.sort_by_key(|k| k.create_revision);
    keys
}

/// Polls `keys(prefix)` until `pred` holds; panics after `within` with what it last saw.
pub fn wait_keys(
    endpoints: &str,
    prefix: &str,
    within: Duration,
    what: &str,
    pred: impl Fn(&[KeyFields]) -> bool,
) -> Vec<KeyFields> {
    let started = Instant::now();
    loop {
        let seen = keys(endpoints, prefix);
        if pred(&seen) {
            return seen;
        }
        assert!(
            started.elapsed() < within,
            "{what}: not within {within:?}; keys {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The shell script of a holder's command: records `$DISTLOCK_TOKEN` and its pid in `$1`, traps SIGTERM
/// (writes `$1/term`, exits 143), and otherwise runs until signalled.
pub const HOLD_SCRIPT: &str = r#"D=$1
trap 'echo term > "$D/term"; exit 143' TERM
echo "${DISTLOCK_TOKEN:-none}" > "$D/token.tmp"; echo $$ > "$D/pid"; mv "$D/token.tmp" "$D/token"
while :; do sleep 0.1; done"#;

/// A `distlock run` process, its stderr in a file of its temp dir.
pub struct Run {
    pub child: Child,
    pub dir: tempfile::TempDir,
    status: Option<ExitStatus>,
}

impl Run {
    /// `distlock run --url URL --lease LEASE [extra…] NAME -- sh -c SCRIPT run <dir>`.
    pub fn spawn(url: &str, lease: &str, extra: &[&str], name: &str, script: &str) -> Run {
        let dir = tempfile::Builder::new()
            .prefix("distlock-etcd-run-")
            .tempdir()
            .expect("temp dir");
        let stderr = std::fs::File::create(dir.path().join("stderr")).expect("stderr file");
        let bin = distlock_testkit::holder::distlock_bin().expect("the distlock binary");
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

/// `distlock run --url URL --no-wait NAME -- true` to completion: its exit code.
pub fn no_wait_run(url: &str, name: &str) -> i32 {
    let bin = distlock_testkit::holder::distlock_bin().expect("the distlock binary");
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

/// Whether `path` exists.
pub fn exists(path: &Path) -> bool {
    path.exists()
}
