//! Pid records, so a later run can clean up after a test process that was SIGKILLed.
//!
//! A SIGKILLed test runs no `Drop`. Its servers normally die with it anyway (the spawner sets
//! `PR_SET_PDEATHSIG`, see [`crate::process`]), but that is a Linux-only safety net with known gaps
//! (credential changes clear it, a server that re-parents a daemon escapes it). So every spawned server
//! also gets a record in `$TMPDIR/distlock-testkit/pids/<server pid>` naming its start time and the test
//! process that owns it (pid + start time). [`sweep`] kills a recorded server only when both hold:
//!
//! * the process with that pid still has the recorded start time (so it *is* the server, not a reused pid);
//! * the owner is gone (no process with that pid, or one with a different start time).
//!
//! Nothing is ever killed by name, and servers of live test processes are left alone.

use std::fs;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rustix::process::{Pid, Signal};

use crate::error::{Error, Result};

/// `$TMPDIR/distlock-testkit/<sub>`, created if missing. Shared by the port locks and the pid records so
/// every test process on the machine agrees on them.
pub(crate) fn state_dir(sub: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join("distlock-testkit").join(sub);
    fs::create_dir_all(&dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    Ok(dir)
}

/// Start time of `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`), or `None` if there is
/// no such process. Together with the pid it names one process for the machine's uptime.
pub fn start_time(pid: u32) -> Option<u64> {
    stat_fields(pid)?
        .get(STAT_STARTTIME)
        .and_then(|f| f.parse().ok())
}

/// Index of field 22 (starttime) among the fields after the `(comm)` field, which is field 2; field 3 is
/// index 0.
const STAT_STARTTIME: usize = 22 - 3;
/// Index of field 3 (state).
const STAT_STATE: usize = 0;
/// Index of field 4 (ppid) among the same fields.
const STAT_PPID: usize = 4 - 3;
/// Index of field 5 (pgrp) among the same fields.
const STAT_PGRP: usize = 5 - 3;

/// The fields of `/proc/<pid>/stat` after `comm`. `comm` may hold spaces and parentheses, so split after
/// the *last* `)`.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Whether `pid` is a live process. One that has exited and only waits to be reaped (a zombie) counts as
/// gone: it runs nothing and holds nothing (pid 1 of a container may be slow to reap orphans).
pub fn is_alive(pid: u32) -> bool {
    stat_fields(pid).is_some_and(|f| f.get(STAT_STATE).is_some_and(|s| s != "Z" && s != "X"))
}

/// Polls every 10 ms until `pid` is gone ([`is_alive`]); whether it went within `within`.
pub fn gone_within(pid: u32, within: std::time::Duration) -> bool {
    let started = std::time::Instant::now();
    while is_alive(pid) {
        if started.elapsed() > within {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    true
}

/// Every live process below `pid` (children, their children, ...), each with its start time, so a later
/// signal can check that the pid still names the same process. A server's children may have left its
/// process group (PostgreSQL's backends call `setsid`), so a group kill alone does not reach them.
pub(crate) fn descendants(pid: u32) -> Vec<(u32, u64)> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut parent_of = Vec::new();
    for entry in entries.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(fields) = stat_fields(child) else {
            continue;
        };
        let parent = fields.get(STAT_PPID).and_then(|f| f.parse::<u32>().ok());
        let started = fields
            .get(STAT_STARTTIME)
            .and_then(|f| f.parse::<u64>().ok());
        if let (Some(parent), Some(started)) = (parent, started) {
            parent_of.push((child, parent, started));
        }
    }
    let mut found: Vec<(u32, u64)> = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for &(child, _, started) in parent_of.iter().filter(|(_, p, _)| *p == parent) {
            if !found.iter().any(|(f, _)| *f == child) {
                found.push((child, started));
                frontier.push(child);
            }
        }
    }
    found
}

/// A zombie has exited already and only waits for its (new) parent to reap it: nothing to kill.
fn is_zombie(pid: u32) -> bool {
    stat_fields(pid).is_some_and(|f| f.get(STAT_STATE).is_some_and(|s| s == "Z"))
}

pub(crate) fn process_group_of(pid: u32) -> Option<u32> {
    stat_fields(pid)?
        .get(STAT_PGRP)
        .and_then(|f| f.parse().ok())
}

/// This test process's pid and start time, read once.
fn self_identity() -> (u32, u64) {
    static ME: OnceLock<(u32, u64)> = OnceLock::new();
    *ME.get_or_init(|| {
        let pid = std::process::id();
        (pid, start_time(pid).unwrap_or(0))
    })
}

/// A pid record on disk; dropping it deletes the file.
///
/// [`crate::process::ServerProcess`] drops its record after killing the server but *before* reaping it:
/// a zombie's pid cannot be reused, so the file it deletes is certainly its own.
#[derive(Debug)]
pub struct PidRecord {
    pid: u32,
    path: PathBuf,
}

impl PidRecord {
    /// Records `pid` (a server this process spawned, started as its own process group) as owned by the
    /// current process.
    pub fn register(pid: u32, name: &str) -> Result<PidRecord> {
        let (owner_pid, owner_start) = self_identity();
        Self::register_with_owner(pid, name, owner_pid, owner_start)
    }

    /// Records `pid` as owned by an arbitrary process. For self-tests that simulate a dead owner, and for a
    /// supervisor that spawns on another process's behalf.
    pub fn register_with_owner(
        pid: u32,
        name: &str,
        owner_pid: u32,
        owner_start: u64,
    ) -> Result<PidRecord> {
        let start = start_time(pid).ok_or_else(|| {
            Error::State(format!("cannot record pid {pid} ({name}): no such process"))
        })?;
        let dir = state_dir("pids")?;
        let path = dir.join(pid.to_string());
        // Write to a dot-file and rename, so a concurrent sweep never reads half a record.
        let tmp = dir.join(format!(".{pid}.{}.tmp", std::process::id()));
        let body = format!(
            "server_pid {pid}\nserver_start {start}\nowner_pid {owner_pid}\nowner_start {owner_start}\nname {}\n",
            name.replace(char::is_whitespace, "_")
        );
        let write = || -> io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(body.as_bytes())?;
            fs::rename(&tmp, &path)
        };
        write().map_err(|e| Error::io(format!("writing pid record {}", path.display()), e))?;
        Ok(PidRecord { pid, path })
    }

    /// The recorded server's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Where the record lives.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PidRecord {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_file(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(path = %self.path.display(), error = %e, "could not remove pid record");
            }
        }
    }
}

/// What one [`sweep`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Servers that were still running with a dead owner and got SIGKILL.
    pub killed: Vec<u32>,
    /// Records deleted because their server was already gone.
    pub stale: Vec<u32>,
    /// Records left alone because their owner is alive.
    pub kept: Vec<u32>,
}

struct Parsed {
    server_pid: u32,
    server_start: u64,
    owner_pid: u32,
    owner_start: u64,
}

fn parse(body: &str) -> Option<Parsed> {
    let field = |key: &str| -> Option<u64> {
        body.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
    };
    Some(Parsed {
        server_pid: u32::try_from(field("server_pid")?).ok()?,
        server_start: field("server_start")?,
        owner_pid: u32::try_from(field("owner_pid")?).ok()?,
        owner_start: field("owner_start")?,
    })
}

/// Kills the servers of test processes that died without cleaning up, and deletes their records.
///
/// Safe to run at any time from any number of processes: it touches only recorded servers whose start
/// time still matches and whose owner is gone.
pub fn sweep() -> Result<SweepReport> {
    let dir = state_dir("pids")?;
    let entries =
        fs::read_dir(&dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    let mut report = SweepReport::default();
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str() else {
            continue;
        };
        if name.starts_with('.') {
            continue; // a record being written
        }
        let path = entry.path();
        let Ok(body) = fs::read_to_string(&path) else {
            continue; // removed by a concurrent sweep
        };
        let Some(rec) = parse(&body) else {
            tracing::warn!(path = %path.display(), "removing unreadable pid record");
            remove_quietly(&path);
            continue;
        };
        let owner_alive = start_time(rec.owner_pid) == Some(rec.owner_start);
        if owner_alive {
            report.kept.push(rec.server_pid);
            continue;
        }
        if start_time(rec.server_pid) == Some(rec.server_start) && !is_zombie(rec.server_pid) {
            kill_leftover(rec.server_pid);
            report.killed.push(rec.server_pid);
        } else {
            report.stale.push(rec.server_pid);
        }
        remove_quietly(&path);
    }
    if !report.killed.is_empty() {
        tracing::info!(killed = ?report.killed, "swept servers left by dead test processes");
    }
    Ok(report)
}

/// SIGKILLs a leftover server's process group (servers are spawned as group leaders, so forked helpers
/// die too). Falls back to the single pid if it is not a group leader, and never signals our own group.
fn kill_leftover(pid: u32) {
    let Some(p) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
        return;
    };
    let own_group = process_group_of(std::process::id());
    let result = if process_group_of(pid) == Some(pid) && own_group != Some(pid) {
        rustix::process::kill_process_group(p, Signal::KILL)
    } else {
        rustix::process::kill_process(p, Signal::KILL)
    };
    if let Err(e) = result {
        tracing::warn!(pid, error = %e, "could not kill leftover server");
    }
}

fn remove_quietly(path: &Path) {
    if let Err(e) = fs::remove_file(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "could not remove pid record");
        }
    }
}

/// Runs [`sweep`] once per process (the first spawn calls it). Failures are logged, never fatal: a sweep
/// is hygiene, not a precondition.
pub fn sweep_once() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        if let Err(e) = sweep() {
            tracing::warn!(error = %e, "pid-record sweep failed");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_start_time_is_known() {
        assert!(start_time(std::process::id()).is_some());
        assert_eq!(start_time(u32::MAX), None);
    }

    #[test]
    fn parses_records() {
        let rec = parse("server_pid 5\nserver_start 7\nowner_pid 9\nowner_start 11\nname x\n");
        let rec = rec.expect("parses");
        assert_eq!(
            (
                rec.server_pid,
                rec.server_start,
                rec.owner_pid,
                rec.owner_start
            ),
            (5, 7, 9, 11)
        );
        assert!(parse("server_pid 5\n").is_none());
    }
}
