//! "Nothing the command started outlives the hold" (issue 7, item 1), as one table of scenarios shared
//! by the file tests (`tests/run.rs`) and the Redis tests (`distlock-redis/tests/distlock_run.rs`, which
//! includes this file by path). Standard library only, so both crates can use it.
//!
//! A first `distlock run` starts a command whose descendant appends `first` to `log` every 50 ms
//! forever, in one of four shapes ([`Shape`]); the hold then ends in one of three ways ([`Ending`]); a
//! second `distlock run` of the same lock appends `second` as soon as it holds the lock. No `first` may
//! follow `second`, and no process of the first tree may be alive afterwards.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How the command's descendant is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// A grandchild in the command's process group (`sh -c 'sh writer; …' &`).
    GrandchildSameGroup,
    /// A grandchild that left the group and session (`setsid`).
    GrandchildAfterSetsid,
    /// A descendant that ignores SIGTERM (`trap '' TERM`, inherited across exec).
    IgnoresTerm,
    /// A background child of the command itself (`writer &`).
    Background,
}

/// How the first hold ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// `distlock` is SIGKILLed (as the OOM killer does); the second run is already waiting.
    KillDistlock,
    /// The lock is lost (`--on-lost term`, `--grace 1s`); the second run starts once the first exited.
    Loss,
    /// The command exits normally, leaving its descendant; the second run is already waiting.
    CommandExits,
}

pub const SHAPES: [Shape; 4] = [
    Shape::GrandchildSameGroup,
    Shape::GrandchildAfterSetsid,
    Shape::IgnoresTerm,
    Shape::Background,
];

const WRITER: &str = "echo $$ >> pids\nwhile :; do echo first >> log; sleep 0.05; done\n";

/// The first run's command: start the descendant, say `ready`, then run on or exit.
fn script(shape: Shape, ending: Ending) -> String {
    let start = match shape {
        Shape::GrandchildSameGroup => "sh -c 'echo $$ >> pids; sh ./writer.sh; true' &",
        Shape::GrandchildAfterSetsid => "setsid sh ./writer.sh &",
        Shape::IgnoresTerm => "sh -c \"trap '' TERM; exec sh ./writer.sh\" &",
        Shape::Background => "sh ./writer.sh &",
    };
    let tail = match ending {
        Ending::CommandExits => "exit 0",
        Ending::KillDistlock | Ending::Loss => "while :; do sleep 0.05; done",
    };
    // Every process of the tree records its pid in `pids`; `log` gets its first line once the writer
    // runs.
    format!("echo $$ >> pids\n{start}\nwhile [ ! -s log ]; do sleep 0.01; done; echo ready > ready\n{tail}")
}

/// Kills (SIGKILL, by pid) whatever of the first tree is still alive when the test ends, pass or fail.
struct Reaper(PathBuf);

impl Drop for Reaper {
    fn drop(&mut self) {
        for pid in pids(&self.0) {
            if is_alive(pid) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    }
}

fn pids(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("pids"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Alive and not a zombie, from /proc.
pub fn is_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|state| state != "Z" && state != "X")
}

fn wait(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs one scenario. `run(args)` is `distlock run --url <service> ARGS…` with `dir` as working
/// directory; `lose(name)` makes the service drop the first run's lock.
pub fn check(
    shape: Shape,
    ending: Ending,
    dir: &Path,
    name: &str,
    run: &dyn Fn(&[&str]) -> Command,
    lose: &dyn Fn(&str),
) {
    let case = format!("{shape:?} × {ending:?}");
    for file in ["log", "pids", "ready"] {
        let _ = std::fs::remove_file(dir.join(file));
    }
    std::fs::write(dir.join("writer.sh"), WRITER).unwrap();
    let _reaper = Reaper(dir.to_path_buf());

    let script = script(shape, ending);
    let mut first = run(&["--grace", "1s", name, "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !dir.join("ready").exists() {
        if let Some(status) = first.try_wait().unwrap() {
            // The command may exit at once (CommandExits) but only after `ready`.
            panic!("{case}: the first run exited ({status}) before its command was ready");
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{case}: never ready"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let tree = pids(dir);
    let expected = if shape == Shape::GrandchildSameGroup {
        3
    } else {
        2
    };
    assert_eq!(tree.len(), expected, "{case}: pids of the tree {tree:?}");
    // Let the descendant write while held.
    std::thread::sleep(Duration::from_millis(200));

    let second_args = [
        "--wait",
        "60s",
        name,
        "--",
        "sh",
        "-c",
        "echo second >> log; sleep 0.5",
    ];
    let mut second = match ending {
        Ending::KillDistlock => {
            let second = run(&second_args).stdin(Stdio::null()).spawn().unwrap();
            // Queued behind the first run before it dies.
            std::thread::sleep(Duration::from_millis(300));
            first.kill().unwrap();
            let status = first.wait().unwrap();
            assert_eq!(status.code(), None, "{case}: {status}");
            second
        }
        Ending::Loss => {
            lose(name);
            let status = wait(&mut first, Duration::from_secs(30), "the first run");
            assert_eq!(status.code(), Some(76), "{case}: {status}");
            run(&second_args).stdin(Stdio::null()).spawn().unwrap()
        }
        Ending::CommandExits => {
            let second = run(&second_args).stdin(Stdio::null()).spawn().unwrap();
            let status = wait(&mut first, Duration::from_secs(30), "the first run");
            assert_eq!(status.code(), Some(0), "{case}: {status}");
            second
        }
    };
    let status = wait(&mut second, Duration::from_secs(60), "the second run");
    assert_eq!(status.code(), Some(0), "{case}: second run {status}");
    // Room for a straggler's write (the writer writes every 50 ms).
    std::thread::sleep(Duration::from_millis(300));

    let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    let second_at = lines
        .iter()
        .position(|l| *l == "second")
        .unwrap_or_else(|| panic!("{case}: the second run never wrote: {lines:?}"));
    assert!(
        second_at > 0 && lines[..second_at].iter().all(|l| *l == "first"),
        "{case}: the first tree never wrote: {lines:?}"
    );
    let late = lines[second_at + 1..]
        .iter()
        .filter(|l| **l == "first")
        .count();
    assert_eq!(
        late, 0,
        "{case}: the first run's descendant wrote {late} lines after the next holder started"
    );
    for pid in pids(dir) {
        assert!(
            !is_alive(pid),
            "{case}: pid {pid} of the first tree is still alive"
        );
    }
}
