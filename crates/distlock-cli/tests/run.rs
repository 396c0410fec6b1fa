//! `distlock run` and `distlock status` as a user runs them: the real binary, real child processes,
//! the file backend in a temporary directory (the memory backend, which lives inside one `distlock`
//! process, only where a simulated partition is needed). Bounds are generous mechanism bounds, never
//! speed figures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::borrow::BorrowMut;
use std::fs;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use distlock_cli::exit::Code;
use distlock_testkit::sweep::is_alive;
use rustix::process::{Pid, Signal};

mod tree;

const BIN: &str = env!("CARGO_BIN_EXE_distlock");
/// How long anything that should happen "soon" may take on a loaded machine.
const SOON: Duration = Duration::from_secs(30);

/// A temporary directory with a lock directory in it, and commands that use it.
struct Sandbox {
    dir: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn url(&self) -> String {
        format!("file://{}/locks", self.dir.path().display())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `distlock` with a clean environment: no inherited URL or token, the default directory inside
    /// the sandbox, and the sandbox as working directory (so scripts use relative file names).
    fn distlock(&self) -> Command {
        let mut command = Command::new(BIN);
        command
            .current_dir(self.dir.path())
            .env_remove("DISTLOCK_URL")
            .env_remove("DISTLOCK_TOKEN")
            .env_remove("DISTLOCK_NAME")
            .env_remove("RUST_LOG")
            .env("XDG_STATE_HOME", self.path("state"))
            .stdin(Stdio::null());
        command
    }

    /// `distlock run --url <sandbox> ARGS…`.
    fn run(&self, args: &[&str]) -> Command {
        let mut command = self.distlock();
        command.arg("run").arg("--url").arg(self.url()).args(args);
        command
    }

    /// `distlock status --url <sandbox> NAME`.
    fn status(&self, name: &str) -> Command {
        let mut command = self.distlock();
        command.arg("status").arg("--url").arg(self.url()).arg(name);
        command
    }

    /// Starts a `run` of `name` whose command records its token and pid, then holds until
    /// [`Holder::finish`]; returns once the command is running.
    fn hold(&self, name: &str) -> Holder {
        let ready = format!("ready-{name}");
        let script = format!(
            "echo $DISTLOCK_TOKEN > token-{name}; echo $$ > {ready}; \
             while [ ! -e stop-{name} ]; do sleep 0.05; done"
        );
        let child = Running::spawn(
            self.run(&[name, "--", "sh", "-c", &script])
                .stdout(Stdio::null()),
        );
        let ready = self.path(&ready);
        wait_until(
            SOON,
            &format!("the holder of {name} to start its command"),
            || non_empty(&ready),
        );
        Holder {
            child,
            stop: self.path(&format!("stop-{name}")),
            token: read_u64(&self.path(&format!("token-{name}"))),
        }
    }
}

/// A `distlock run` that holds a lock until told to stop.
struct Holder {
    child: Running,
    stop: PathBuf,
    /// The `DISTLOCK_TOKEN` its command got.
    token: u64,
}

impl Holder {
    /// Lets the command finish and expects `distlock` to exit 0.
    fn finish(mut self) {
        fs::write(&self.stop, "").unwrap();
        let status = self.child.wait(SOON);
        assert_eq!(status.code(), Some(0), "holder exit: {status:?}");
    }

    fn pid(&self) -> u32 {
        self.child.pid
    }
}

/// A child process that is SIGKILLed if the test ends (or panics) with it still running; `distlock`'s
/// supervisor then kills everything its command started.
struct Running {
    child: Option<Child>,
    pid: u32,
}

impl Running {
    fn spawn(command: &mut Command) -> Self {
        let child = command.spawn().unwrap();
        Self {
            pid: child.id(),
            child: Some(child),
        }
    }

    /// Waits for the exit, failing the test after `limit`.
    fn wait(&mut self, limit: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("already waited");
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "process {} still running after {limit:?}",
                self.pid
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What a finished command printed and how it exited.
struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    took: Duration,
}

impl Finished {
    fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Asserts the exit code, showing stderr if it differs.
    fn expect_code(&self, code: i32) -> &Self {
        assert_eq!(
            self.code(),
            Some(code),
            "status {:?}; stderr: {}",
            self.status,
            self.stderr
        );
        self
    }

    /// Asserts stderr is one `distlock: …` line and returns it.
    fn one_error_line(&self) -> &str {
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(
            lines.len(),
            1,
            "expected one line on stderr, got: {:?}",
            self.stderr
        );
        assert!(
            lines[0].starts_with("distlock: ") && lines[0].len() > 12,
            "stderr: {:?}",
            self.stderr
        );
        lines[0]
    }
}

/// Runs a command to completion with output captured, failing the test after `limit`.
fn finish(mut command: impl BorrowMut<Command>, limit: Duration) -> Finished {
    let command = command.borrow_mut();
    let start = Instant::now();
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut stdout = String::new();
        let mut stderr = String::new();
        let _ = out.read_to_string(&mut stdout);
        let _ = err.read_to_string(&mut stderr);
        let _ = tx.send((child.wait(), stdout, stderr));
    });
    match rx.recv_timeout(limit) {
        Ok((status, stdout, stderr)) => Finished {
            status: status.unwrap(),
            stdout,
            stderr,
            took: start.elapsed(),
        },
        Err(_) => {
            let _ = rustix::process::kill_process(Pid::from_raw(pid as i32).unwrap(), Signal::KILL);
            panic!("{command:?} still running after {limit:?}");
        }
    }
}

fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn non_empty(path: &Path) -> bool {
    fs::read_to_string(path).is_ok_and(|s| s.ends_with('\n'))
}

fn read_u64(path: &Path) -> u64 {
    let text = fs::read_to_string(path).unwrap();
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{} holds {text:?}, not a number", path.display()))
}

fn lines(path: &Path) -> Vec<String> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Whether `pid` has a handler installed for signal `signo` (SigCgt in /proc/<pid>/status).
fn catches(pid: u32, signo: u32) -> bool {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (signo - 1)) != 0)
}

/// The process group of `pid`, from /proc.
fn process_group(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After "pid (comm)": state, ppid, pgrp.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(2)?
        .parse()
        .ok()
}

/// A lock that is free can be taken at once by a `--no-wait` run.
fn assert_free(sandbox: &Sandbox, name: &str) {
    finish(sandbox.run(&["--no-wait", name, "--", "true"]), SOON).expect_code(0);
}

// --- 1. mutual exclusion and tokens -------------------------------------------------------------

#[test]
fn concurrent_runs_take_turns_with_increasing_tokens() {
    let sandbox = Sandbox::new();
    let script =
        "echo \"start $DISTLOCK_TOKEN\" >> log; sleep 0.2; echo \"end $DISTLOCK_TOKEN\" >> log";
    let mut runs: Vec<Running> = (0..4)
        .map(|_| Running::spawn(&mut sandbox.run(&["shared", "--", "sh", "-c", script])))
        .collect();
    for run in &mut runs {
        assert_eq!(run.wait(Duration::from_secs(60)).code(), Some(0));
    }
    let log = lines(&sandbox.path("log"));
    assert_eq!(log.len(), 8, "log: {log:?}");
    let mut last = 0;
    for pair in log.chunks(2) {
        let start = pair[0]
            .strip_prefix("start ")
            .unwrap_or_else(|| panic!("interleaved: {log:?}"));
        let end = pair[1]
            .strip_prefix("end ")
            .unwrap_or_else(|| panic!("interleaved: {log:?}"));
        assert_eq!(start, end, "interleaved: {log:?}");
        let token: u64 = start
            .parse()
            .unwrap_or_else(|_| panic!("no token: {log:?}"));
        assert!(token > last, "tokens not strictly increasing: {log:?}");
        last = token;
    }
}

// --- 2 and 3. busy and timed out: the command does not run ---------------------------------------

#[test]
fn no_wait_on_a_held_lock_exits_75_without_running() {
    let sandbox = Sandbox::new();
    let holder = sandbox.hold("busy");
    let out = finish(
        sandbox.run(&["--no-wait", "busy", "--", "touch", "marker"]),
        SOON,
    );
    out.expect_code(Code::Busy.as_i32());
    assert!(
        out.one_error_line().contains("held elsewhere"),
        "{}",
        out.stderr
    );
    assert!(!sandbox.path("marker").exists(), "the command ran");
    // `--wait 0` is the same.
    finish(
        sandbox.run(&["--wait", "0s", "busy", "--", "touch", "marker"]),
        SOON,
    )
    .expect_code(Code::Busy.as_i32());
    assert!(!sandbox.path("marker").exists(), "the command ran");

    holder.finish();
    finish(
        sandbox.run(&["--no-wait", "busy", "--", "touch", "marker"]),
        SOON,
    )
    .expect_code(0);
    assert!(
        sandbox.path("marker").exists(),
        "the command did not run on a free lock"
    );
}

#[test]
fn wait_limit_on_a_held_lock_exits_124_without_running() {
    let sandbox = Sandbox::new();
    let holder = sandbox.hold("slow");
    let out = finish(
        sandbox.run(&["--wait", "1s", "slow", "--", "touch", "marker"]),
        SOON,
    );
    out.expect_code(Code::Timeout.as_i32());
    out.one_error_line();
    assert!(
        out.took >= Duration::from_secs(1),
        "gave up before the wait limit: {:?}",
        out.took
    );
    assert!(!sandbox.path("marker").exists(), "the command ran");
    holder.finish();
    assert_free(&sandbox, "slow");
}

#[test]
fn interrupted_wait_exits_130_and_takes_nothing() {
    let sandbox = Sandbox::new();
    let holder = sandbox.hold("queue");
    let mut waiter = Running::spawn(
        sandbox
            .run(&["queue", "--", "touch", "marker"])
            .stderr(Stdio::null()),
    );
    // Once distlock catches SIGINT it is connecting or waiting; either way a SIGINT ends the wait.
    wait_until(SOON, "distlock to catch SIGINT", || catches(waiter.pid, 2));
    std::thread::sleep(Duration::from_millis(300));
    rustix::process::kill_process(Pid::from_raw(waiter.pid as i32).unwrap(), Signal::INT).unwrap();
    let status = waiter.wait(SOON);
    assert_eq!(status.code(), Some(128 + 2), "{status:?}");
    holder.finish();
    assert!(
        !sandbox.path("marker").exists(),
        "the interrupted waiter ran its command"
    );
    assert_free(&sandbox, "queue");
}

// --- 4. exit codes -----------------------------------------------------------------------------

#[test]
fn the_commands_exit_code_passes_through() {
    let sandbox = Sandbox::new();
    let code =
        |script: &str| finish(sandbox.run(&["codes", "--", "sh", "-c", script]), SOON).code();
    assert_eq!(code("exit 0"), Some(0));
    assert_eq!(code("exit 7"), Some(7));
    assert_eq!(
        code("test \"$DISTLOCK_NAME\" = codes && test -n \"$DISTLOCK_TOKEN\""),
        Some(0)
    );
    assert_eq!(code("kill -KILL $$"), Some(128 + 9));
    assert_eq!(code("kill -TERM $$"), Some(128 + 15));
    assert_free(&sandbox, "codes");
}

/// `--fair` on an engine with no queue of waiters is a usage error (64) before anything runs: the
/// user asked for an order the file backend cannot keep.
#[test]
fn fair_on_the_file_backend_exits_64_without_running() {
    let sandbox = Sandbox::new();
    let ran = sandbox.path("ran-fair");
    let finished = finish(
        sandbox.run(&[
            "--fair",
            "fair",
            "--",
            "sh",
            "-c",
            &format!("touch {}", ran.display()),
        ]),
        SOON,
    );
    finished.expect_code(64);
    assert!(finished.stderr.contains("--fair"), "{}", finished.stderr);
    assert!(!ran.exists(), "the command ran");
}

/// The supervisor holds a duplicate of the flocked descriptor; the command must not inherit it (a
/// descendant that escaped would otherwise keep the lock held, and a command could unlock it).
#[test]
fn the_command_does_not_inherit_the_lock_descriptor() {
    let sandbox = Sandbox::new();
    let out = finish(
        sandbox.run(&[
            "fds",
            "--",
            "sh",
            "-c",
            "for fd in /proc/$$/fd/*; do readlink \"$fd\" || true; done",
        ]),
        SOON,
    );
    out.expect_code(0);
    let open: Vec<&str> = out.stdout.lines().collect();
    assert!(
        open.iter().any(|target| target.starts_with("pipe:")),
        "the listing itself failed: {:?} {:?}",
        out.stdout,
        out.stderr
    );
    assert!(
        open.iter().all(|target| !target.ends_with(".lock")),
        "the command inherited a lock file: {open:?}"
    );
    assert_free(&sandbox, "fds");
}

#[test]
fn commands_that_cannot_run_exit_126_or_127() {
    let sandbox = Sandbox::new();
    let out = finish(
        sandbox.run(&["exec", "--", "no-such-command-distlock-test"]),
        SOON,
    );
    out.expect_code(Code::NotFound.as_i32());
    assert!(out
        .one_error_line()
        .contains("no-such-command-distlock-test"));
    finish(sandbox.run(&["exec", "--", "./missing"]), SOON).expect_code(Code::NotFound.as_i32());

    fs::write(sandbox.path("not-executable"), "#!/bin/sh\n").unwrap();
    let out = finish(sandbox.run(&["exec", "--", "./not-executable"]), SOON);
    out.expect_code(Code::CannotExecute.as_i32());
    out.one_error_line();
    assert_free(&sandbox, "exec");
}

// --- 5. the command never outlives its holder --------------------------------------------------

#[test]
fn a_sigkilled_distlock_takes_its_command_along() {
    let sandbox = Sandbox::new();
    let mut run = Running::spawn(&mut sandbox.run(&[
        "doomed",
        "--",
        "sh",
        "-c",
        "echo $$ > pid; exec sleep 120",
    ]));
    wait_until(SOON, "the command to start", || {
        non_empty(&sandbox.path("pid"))
    });
    let pid = read_u64(&sandbox.path("pid")) as u32;
    assert!(is_alive(pid));

    rustix::process::kill_process(Pid::from_raw(run.pid as i32).unwrap(), Signal::KILL).unwrap();
    assert_eq!(run.wait(SOON).signal(), Some(9));
    wait_until(
        Duration::from_secs(10),
        "the command to die with distlock",
        || !is_alive(pid),
    );
    assert_free(&sandbox, "doomed");
}

/// Every shape of descendant (same-group grandchild, `setsid` grandchild, one ignoring SIGTERM, a
/// background child) is dead before the next holder of the lock starts, whichever way the hold ends.
fn tree_dies_before_the_next_holder(ending: tree::Ending) {
    for shape in tree::SHAPES {
        let sandbox = Sandbox::new();
        let run = |args: &[&str]| sandbox.run(args);
        let lose = |name: &str| {
            // Deleting the lock file loses the hold (the guard watches it); a new file is free.
            fs::remove_file(
                sandbox
                    .dir
                    .path()
                    .join("locks")
                    .join(format!("{name}.lock")),
            )
            .unwrap();
        };
        tree::check(shape, ending, sandbox.dir.path(), "tree", &run, &lose);
    }
}

#[test]
fn a_sigkilled_distlocks_whole_tree_dies_before_the_next_holder_fault() {
    tree_dies_before_the_next_holder(tree::Ending::KillDistlock);
}

#[test]
fn on_loss_the_whole_tree_dies_before_distlock_exits_fault() {
    tree_dies_before_the_next_holder(tree::Ending::Loss);
}

#[test]
fn leftover_descendants_die_before_the_release_fault() {
    tree_dies_before_the_next_holder(tree::Ending::CommandExits);
}

/// What to type into the terminal of [`under_terminal`].
enum Typing {
    /// Written at once (the terminal buffers it until something reads).
    AtOnce(&'static [u8]),
    /// Written once the command has recorded its pid in `pid`, and `pause` after that.
    AfterStart(&'static [u8], Duration),
}

/// Runs the shell `script` under a pseudo-terminal from `script(1)`, types `typing` into it, and returns
/// the terminal's output and script(1)'s stderr. After `limit` it kills `distlock` (the grandparent of the
/// command, if it recorded its pid in `pid`) and script(1), and fails the test with `hung`.
fn under_terminal(
    sandbox: &Sandbox,
    script: &str,
    typing: Typing,
    limit: Duration,
    hung: &str,
) -> (String, String) {
    use std::io::Write;
    fs::write(sandbox.path("tty.sh"), script).unwrap();
    let mut child = Command::new("script")
        .args(["-qec", "sh ./tty.sh", "/dev/null"])
        .current_dir(sandbox.dir.path())
        .env_remove("DISTLOCK_URL")
        .env_remove("DISTLOCK_TOKEN")
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script(1) from util-linux is needed for the terminal tests");
    let mut stdin = child.stdin.take().unwrap();
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match typing {
        Typing::AtOnce(text) => stdin.write_all(text).unwrap(),
        Typing::AfterStart(text, pause) => {
            wait_until(SOON, "the command to start", || {
                non_empty(&sandbox.path("pid"))
            });
            std::thread::sleep(pause);
            stdin.write_all(text).unwrap();
        }
    }
    let out = match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // distlock (the command's grandparent) takes the stopped command along when killed.
            if let Some(distlock) = fs::read_to_string(sandbox.path("pid"))
                .ok()
                .and_then(|p| p.trim().parse().ok())
                .and_then(parent)
                .and_then(parent)
            {
                let _ = rustix::process::kill_process(
                    Pid::from_raw(distlock as i32).unwrap(),
                    Signal::KILL,
                );
            }
            let _ = rustix::process::kill_process(Pid::from_raw(pid as i32).unwrap(), Signal::KILL);
            panic!("{hung}");
        }
    };
    drop(stdin);
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Under a terminal (a pty from `script(1)`), the command gets the terminal's foreground: it reads what
/// is typed (a background process group would be stopped by SIGTTIN instead); afterwards the shell that
/// ran `distlock` has the terminal back and reads the next line.
#[test]
fn an_interactive_command_gets_the_terminal_and_gives_it_back() {
    let sandbox = Sandbox::new();
    let script = format!(
        "'{BIN}' run --url '{}' tty -- sh -c 'test -t 0 && read x && echo \"got:$x\"'\n\
         echo \"rc:$?\"\nread y\necho \"after:$y\"\n",
        sandbox.url()
    );
    let (stdout, stderr) = under_terminal(
        &sandbox,
        &script,
        Typing::AtOnce(b"hello\nworld\n"),
        SOON,
        "the command under a terminal hung (stopped by SIGTTIN?)",
    );
    for expected in ["got:hello", "rc:0", "after:world"] {
        assert!(
            stdout.contains(expected),
            "no {expected:?} in the terminal's output: {stdout:?}; stderr: {stderr}"
        );
    }
}

/// In a pipeline under a terminal (`echo x | distlock run … -- sudo …`), stdin is no terminal, but the
/// command may still read the controlling terminal through /dev/tty (sudo's password prompt, ssh's
/// passphrase), as it could without distlock, where it would be in the foreground process group. Its
/// own process group must then be the terminal's foreground too, or SIGTTIN stops it for good while
/// distlock holds the lock.
#[test]
fn a_command_in_a_pipeline_reads_the_controlling_terminal() {
    let sandbox = Sandbox::new();
    let script = format!(
        "echo piped | '{BIN}' run --url '{}' devtty -- sh -c \
         'echo $$ > pid; read x < /dev/tty && read y && echo \"got:$x:$y\"'\n\
         echo \"rc:$?\"\nread z\necho \"after:$z\"\n",
        sandbox.url()
    );
    let (stdout, stderr) = under_terminal(
        &sandbox,
        &script,
        Typing::AtOnce(b"hello\nworld\n"),
        Duration::from_secs(15),
        "the command reading /dev/tty hung (stopped by SIGTTIN in a background group)",
    );
    for expected in ["got:hello:piped", "rc:0", "after:world"] {
        assert!(
            stdout.contains(expected),
            "no {expected:?} in the terminal's output: {stdout:?}; stderr: {stderr}"
        );
    }
}

/// `distlock run … | less` under a terminal: the pager, in distlock's process group (the shell's job),
/// reads the terminal while the command runs. Handing the terminal to the command's group would stop the
/// pager with SIGTTIN (under a shell without job control its read fails with EIO), so with another
/// member of its job alive distlock keeps the terminal for the job until the command wants it.
#[test]
fn a_pager_after_distlock_in_a_pipeline_keeps_the_terminal() {
    let sandbox = Sandbox::new();
    let script = format!(
        "'{BIN}' run --url '{}' pager -- sh -c 'echo $$ > pid; echo line; sleep 3' | \
         sh -c 'read first; read x < /dev/tty; echo \"pager:$first:$x\"'\n\
         echo \"rc:$?\"\n",
        sandbox.url()
    );
    let (stdout, stderr) = under_terminal(
        &sandbox,
        &script,
        Typing::AfterStart(b"hello\n", Duration::from_millis(300)),
        Duration::from_secs(15),
        "the pager hung (stopped by SIGTTIN: the command's group had the terminal)",
    );
    assert!(
        stdout.contains("pager:line:hello") && stdout.contains("rc:0"),
        "the terminal's output: {stdout:?}; stderr: {stderr}"
    );
}

/// The other half of the pager case: with another process in distlock's group (here `| cat`), a
/// descendant of the command that prompts through /dev/tty (sudo inside a deploy script) is stopped by
/// SIGTTIN in the command's background group; the supervisor then hands the command's group the
/// terminal and continues it, so the prompt reads what is typed instead of hanging with the lock held.
#[test]
fn a_prompt_inside_a_piped_command_gets_the_terminal_on_demand() {
    let sandbox = Sandbox::new();
    let script = format!(
        "'{BIN}' run --url '{}' prompt -- sh -c \
         'echo $$ > pid; sh -c \"read x < /dev/tty; echo got:\\$x\"' | cat\n\
         echo \"rc:$?\"\n",
        sandbox.url()
    );
    let (stdout, stderr) = under_terminal(
        &sandbox,
        &script,
        Typing::AfterStart(b"hello\n", Duration::from_millis(500)),
        Duration::from_secs(15),
        "the prompt hung (stopped by SIGTTIN in the command's background group)",
    );
    assert!(
        stdout.contains("got:hello") && stdout.contains("rc:0"),
        "the terminal's output: {stdout:?}; stderr: {stderr}"
    );
}

/// Ctrl-Z on an interactive command (SIGTSTP to its process group, which has the terminal) suspends
/// the whole job: the interactive shell that ran `distlock` gets the terminal back and reads the next
/// line; `fg` resumes the command with the terminal, and it reads what is typed then. (Before, the
/// stopped command kept the terminal while `distlock` kept running: the shell never got it back and
/// Ctrl-C went to the stopped group, so the terminal hung.)
#[test]
fn ctrl_z_suspends_the_job_and_fg_resumes_it_with_the_terminal() {
    use std::io::Write;
    use std::sync::{Arc, Mutex};
    let sandbox = Sandbox::new();
    let mut child = Command::new("script")
        .args(["-qec", "bash --norc --noprofile -i", "/dev/null"])
        .current_dir(sandbox.dir.path())
        .env_remove("DISTLOCK_URL")
        .env_remove("DISTLOCK_TOKEN")
        .env_remove("RUST_LOG")
        .env("PS1", "$ ")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("script(1) and bash are needed for the job-control test");
    let pid = child.id();
    struct KillOnDrop(u32);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ =
                rustix::process::kill_process(Pid::from_raw(self.0 as i32).unwrap(), Signal::KILL);
        }
    }
    let _script = KillOnDrop(pid);
    let output = Arc::new(Mutex::new(String::new()));
    let mut stdout = child.stdout.take().unwrap();
    let sink = Arc::clone(&output);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let mut stdin = child.stdin.take().unwrap();
    let mut type_in = |text: &str| {
        stdin.write_all(text.as_bytes()).unwrap();
        stdin.flush().unwrap();
    };
    let shown = |what: &str| output.lock().unwrap().contains(what);
    // Give bash a moment to set up job control before typing.
    std::thread::sleep(Duration::from_millis(500));
    type_in(&format!(
        "'{BIN}' run --url '{}' tstp -- sh -c 'echo $$ > pid; read x; echo \"got:$x\"'\n",
        sandbox.url()
    ));
    wait_until(SOON, "the command to start", || {
        non_empty(&sandbox.path("pid"))
    });
    // The command is reading the terminal now (or about to): Ctrl-Z.
    std::thread::sleep(Duration::from_millis(300));
    type_in("\x1a");
    std::thread::sleep(Duration::from_millis(300));
    // Computed by the shell, so the echo of the typed line does not count.
    type_in("echo back-$((40+2))\n");
    wait_until(
        Duration::from_secs(10),
        "the shell to get the terminal back after Ctrl-Z",
        || shown("back-42"),
    );
    type_in("fg\n");
    std::thread::sleep(Duration::from_millis(500));
    type_in("hello\n");
    wait_until(
        SOON,
        "the resumed command to read from the terminal",
        || shown("got:hello"),
    );
    type_in("echo rc-$?-$((1+1))\n");
    wait_until(SOON, "distlock to exit 0 after the resumed command", || {
        shown("rc-0-2")
    });
    type_in("exit\n");
    drop(stdin);
    wait_until(SOON, "the shell to exit", || {
        child.try_wait().ok().flatten().is_some()
    });
}

/// On `file://` the supervisor holds the lock's descriptor: with the supervisor stopped (so it cannot act
/// yet), SIGKILLing `distlock` leaves the lock held; once the supervisor continues, it kills the tree and
/// exits, and only then is the lock free.
#[test]
fn the_file_lock_outlives_a_sigkilled_distlock_until_the_tree_is_dead_fault() {
    // The orphaned supervisor is reparented to this test process, in the same session: otherwise its
    // process group would be orphaned with a stopped member, and the kernel would continue it at once.
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).unwrap();
    let sandbox = Sandbox::new();
    let mut run = Running::spawn(&mut sandbox.run(&[
        "handoff",
        "--",
        "sh",
        "-c",
        "echo $$ > pid; exec sleep 120",
    ]));
    wait_until(SOON, "the command to start", || {
        non_empty(&sandbox.path("pid"))
    });
    let command = read_u64(&sandbox.path("pid")) as u32;
    let supervisor = parent(command).expect("the command's parent");
    assert_ne!(
        supervisor, run.pid,
        "the command runs under a supervisor, not distlock"
    );
    let supervisor_pid = Pid::from_raw(supervisor as i32).unwrap();
    rustix::process::kill_process(supervisor_pid, Signal::STOP).unwrap();

    rustix::process::kill_process(Pid::from_raw(run.pid as i32).unwrap(), Signal::KILL).unwrap();
    assert_eq!(run.wait(SOON).signal(), Some(9));
    finish(sandbox.run(&["--no-wait", "handoff", "--", "true"]), SOON)
        .expect_code(Code::Busy.as_i32());
    assert!(is_alive(command));

    rustix::process::kill_process(supervisor_pid, Signal::CONT).unwrap();
    wait_until(SOON, "the supervisor to kill the command and exit", || {
        !is_alive(command) && !is_alive(supervisor)
    });
    assert_free(&sandbox, "handoff");
}

/// The supervisor itself SIGKILLed (by `pkill -9 distlock`, which matches its name `distlock-super`, or
/// the OOM killer): the command dies by its parent-death signal, but a descendant that left the
/// command's process group would be orphaned out of reach. `distlock` still holds the lock then, so it
/// must kill what is left before its release lets the next holder in.
#[test]
fn a_sigkilled_supervisors_tree_dies_before_the_release_fault() {
    let sandbox = Sandbox::new();
    let mut run = Running::spawn(
        sandbox
            .run(&[
                "orphans",
                "--",
                "sh",
                "-c",
                "setsid sh -c 'echo $$ > grandchild; exec sleep 120' & echo $$ > pid; wait",
            ])
            .stderr(Stdio::null()),
    );
    wait_until(SOON, "the command and its grandchild to start", || {
        non_empty(&sandbox.path("pid")) && non_empty(&sandbox.path("grandchild"))
    });
    let command = read_u64(&sandbox.path("pid")) as u32;
    let grandchild = read_u64(&sandbox.path("grandchild")) as u32;
    let supervisor = parent(command).expect("the command's parent");
    assert_ne!(supervisor, run.pid);
    // Whatever the outcome, nothing of this test outlives it.
    struct KillOnDrop(u32);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            if is_alive(self.0) {
                let _ = rustix::process::kill_process(
                    Pid::from_raw(self.0 as i32).unwrap(),
                    Signal::KILL,
                );
            }
        }
    }
    let _grandchild = KillOnDrop(grandchild);

    rustix::process::kill_process(Pid::from_raw(supervisor as i32).unwrap(), Signal::KILL).unwrap();
    let status = run.wait(SOON);
    // distlock has released the lock by now: the grandchild must already be dead.
    assert!(
        !is_alive(grandchild),
        "distlock exited ({status:?}) and released the lock with the command's grandchild {grandchild} still running"
    );
    assert_eq!(
        status.code(),
        Some(Code::Unavailable.as_i32()),
        "{status:?}"
    );
    assert_free(&sandbox, "orphans");
}

/// The parent of `pid`, from /proc.
fn parent(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

// --- 6. signals reach the command exactly once ----------------------------------------------------

#[test]
fn signals_reach_the_command_exactly_once() {
    let sandbox = Sandbox::new();
    let signals = [
        ("TERM", Signal::TERM),
        ("INT", Signal::INT),
        ("HUP", Signal::HUP),
        ("QUIT", Signal::QUIT),
    ];
    let mut runs = Vec::new();
    for (name, _) in signals {
        // `wait` returns as soon as a trapped signal arrives, so the trap runs at once and a second
        // copy a moment later runs it again (a foreground `sleep` would let the two merge).
        let script = format!(
            "trap 'echo {name} >> sig-{name}' {name}; echo $$ > ready-{name}; \
             while [ ! -e stop-{name} ]; do sleep 0.05 & wait $!; done; exit 0"
        );
        // Its own process group, which the test signals as a terminal would signal the foreground
        // job: had the command stayed in distlock's group it would get the signal twice.
        let run = Running::spawn(
            sandbox
                .run(&[&format!("sig-{name}"), "--", "sh", "-c", &script])
                .process_group(0),
        );
        runs.push(run);
    }
    for ((name, signal), run) in signals.iter().zip(&runs) {
        let ready = sandbox.path(&format!("ready-{name}"));
        wait_until(SOON, "the command to start", || non_empty(&ready));
        // The command leads a process group of its own, so a group-wide signal to distlock's group
        // cannot also reach it directly.
        let pid = read_u64(&ready) as u32;
        assert_eq!(
            process_group(pid),
            Some(pid),
            "the command does not lead its own process group"
        );
        rustix::process::kill_process_group(Pid::from_raw(run.pid as i32).unwrap(), *signal)
            .unwrap();
    }
    for (name, _) in signals {
        wait_until(SOON, &format!("SIG{name} to reach the command"), || {
            !lines(&sandbox.path(&format!("sig-{name}"))).is_empty()
        });
    }
    // Room for a second copy to arrive, had one been sent.
    std::thread::sleep(Duration::from_secs(1));
    for ((name, _), run) in signals.iter().zip(&mut runs) {
        fs::write(sandbox.path(&format!("stop-{name}")), "").unwrap();
        let status = run.wait(SOON);
        assert_eq!(status.code(), Some(0), "SIG{name}: {status:?}");
        assert_eq!(
            lines(&sandbox.path(&format!("sig-{name}"))),
            [*name],
            "SIG{name} not delivered exactly once"
        );
    }
}

/// `nohup distlock run …` (or a shell's `trap '' HUP` before it): SIGHUP was ignored when distlock
/// started, so a hangup must not end the command: distlock does not catch and forward it, and the command
/// inherits it ignored, as it would without distlock. Before, distlock forwarded it to the command,
/// whose disposition the supervisor had reset to the default: the command died.
#[test]
fn signals_ignored_at_start_stay_ignored_for_the_command() {
    let sandbox = Sandbox::new();
    let script = "grep ^SigIgn /proc/$$/status > ign; echo $$ > pid; \
                  while [ ! -e stop ]; do sleep 0.05; done";
    // As nohup does: SIGHUP ignored, then exec distlock.
    let mut run = Running::spawn(
        Command::new("sh")
            .current_dir(sandbox.dir.path())
            .env_remove("DISTLOCK_URL")
            .env_remove("DISTLOCK_TOKEN")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .args([
                "-c",
                &format!(
                    "trap '' HUP; exec '{BIN}' run --url '{}' nohup -- sh -c '{script}'",
                    sandbox.url()
                ),
            ]),
    );
    wait_until(SOON, "the command to start", || {
        non_empty(&sandbox.path("pid"))
    });
    let ignored = fs::read_to_string(sandbox.path("ign")).unwrap();
    let mask = u64::from_str_radix(ignored.trim_start_matches("SigIgn:").trim(), 16).unwrap();
    assert_ne!(
        mask & 1,
        0,
        "SIGHUP is not ignored in the command: {ignored}"
    );
    // distlock is the process sh exec'd: a hangup to it.
    rustix::process::kill_process(Pid::from_raw(run.pid as i32).unwrap(), Signal::HUP).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let command = read_u64(&sandbox.path("pid")) as u32;
    assert!(
        is_alive(command),
        "SIGHUP ended the command started under nohup"
    );
    fs::write(sandbox.path("stop"), "").unwrap();
    assert_eq!(run.wait(SOON).code(), Some(0));
}

// --- 7. the lock is lost while the command runs -------------------------------------------------

/// A memory URL whose server side freezes `after` the process connects, as on a partition.
fn partitioned(after: &str) -> String {
    format!("memory://loss?freeze_after={after}")
}

#[test]
fn on_loss_the_command_gets_sigterm_then_sigkill_after_the_grace() {
    let sandbox = Sandbox::new();
    let script = "trap 'echo TERM >> log' TERM; echo $$ > pid; while :; do sleep 0.1; echo alive >> log; done";
    let mut command = sandbox.distlock();
    command.args([
        "run",
        "--url",
        &partitioned("1s"),
        "--lease",
        "1s",
        "--grace",
        "2s",
        "lost",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let out = finish(&mut command, Duration::from_secs(60));
    out.expect_code(Code::Lost.as_i32());
    let loss = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("distlock: "))
        .collect::<Vec<_>>();
    assert!(
        loss.len() == 1 && loss[0].contains("lost") && loss[0].contains("SIGTERM"),
        "stderr: {}",
        out.stderr
    );

    let log = lines(&sandbox.path("log"));
    let term = log
        .iter()
        .position(|l| l == "TERM")
        .unwrap_or_else(|| panic!("no SIGTERM: {log:?}"));
    assert_eq!(
        log.iter().filter(|l| *l == "TERM").count(),
        1,
        "log: {log:?}"
    );
    assert!(
        log[term + 1..].iter().any(|l| l == "alive"),
        "the command did not get its grace: {log:?}"
    );
    // It never stops by itself, so it was killed; and it is gone.
    let pid = read_u64(&sandbox.path("pid")) as u32;
    wait_until(Duration::from_secs(10), "the command to be gone", || {
        !is_alive(pid)
    });
}

#[test]
fn on_loss_with_kill_the_command_gets_sigkill_at_once() {
    let sandbox = Sandbox::new();
    let script = "trap 'echo TERM >> log' TERM; while :; do sleep 0.1; done";
    let mut command = sandbox.distlock();
    command.args([
        "run",
        "--url",
        &partitioned("500ms"),
        "--lease",
        "1s",
        "--on-lost",
        "kill",
        "lost",
        "--",
        "sh",
        "-c",
        script,
    ]);
    finish(&mut command, Duration::from_secs(60)).expect_code(Code::Lost.as_i32());
    assert!(
        lines(&sandbox.path("log")).is_empty(),
        "the command got SIGTERM"
    );
}

#[test]
fn on_loss_with_ignore_the_command_finishes_and_distlock_exits_76() {
    let sandbox = Sandbox::new();
    let mut command = sandbox.distlock();
    command.args([
        "run",
        "--url",
        &partitioned("500ms"),
        "--lease",
        "1s",
        "--on-lost",
        "ignore",
        "lost",
        "--",
        "sh",
        "-c",
        "sleep 6; echo done > out",
    ]);
    let out = finish(&mut command, Duration::from_secs(60));
    out.expect_code(Code::Lost.as_i32());
    assert!(out.stderr.contains("lost"), "stderr: {}", out.stderr);
    assert_eq!(
        lines(&sandbox.path("out")),
        ["done"],
        "the command did not run to completion"
    );
}

/// A loss is one line on stderr, `distlock: lock … lost: …; <what was done>`, not also a log line of the
/// library and another of the backend; `-v` shows those.
#[test]
fn a_loss_prints_one_line_unless_verbose() {
    for verbose in [false, true] {
        let sandbox = Sandbox::new();
        let mut args = vec![
            "--grace",
            "1s",
            "gone",
            "--",
            "sh",
            "-c",
            "echo $$ > pid; exec sleep 60",
        ];
        if verbose {
            args.insert(0, "-v");
        }
        let mut command = sandbox.run(&args);
        let pid_file = sandbox.path("pid");
        let lock_file = sandbox.path("locks/gone.lock");
        let deleter = std::thread::spawn(move || {
            wait_until(SOON, "the command to start", || non_empty(&pid_file));
            fs::remove_file(lock_file).unwrap();
        });
        let out = finish(&mut command, SOON);
        deleter.join().unwrap();
        out.expect_code(Code::Lost.as_i32());
        if verbose {
            assert!(
                out.stderr.lines().count() > 1 && out.stderr.contains("WARN"),
                "-v shows the log lines too: {}",
                out.stderr
            );
        } else {
            let line = out.one_error_line();
            assert!(line.contains("lost") && line.contains("SIGTERM"), "{line}");
        }
    }
}

// --- 8. bad input: exit 64, one line, nothing locked -------------------------------------------

/// A --grace the parser accepts but whose milliseconds do not fit in 64 bits (longer than half a billion
/// years: forever, in effect) still runs the command; it made the supervisor refuse its arguments, after
/// the lock was taken, with exit 126 and an "internal error".
#[test]
fn an_enormous_grace_still_runs_the_command() {
    let sandbox = Sandbox::new();
    let out = finish(
        sandbox.run(&[
            "--grace",
            "99999999999999h",
            "forever",
            "--",
            "touch",
            "marker",
        ]),
        SOON,
    );
    out.expect_code(0);
    assert_eq!(out.stderr, "");
    assert!(sandbox.path("marker").exists(), "the command did not run");
}

#[test]
fn bad_input_exits_64_with_one_line_and_locks_nothing() {
    let sandbox = Sandbox::new();
    let url = sandbox.url();
    let long_name = "n".repeat(2048);
    let cases: Vec<Vec<&str>> = vec![
        vec!["--url", "gopher://host", "bad", "--", "touch", "marker"],
        vec!["--url", "file://", "bad", "--", "touch", "marker"],
        vec![
            "--url",
            "redis://h:notaport",
            "bad",
            "--",
            "touch",
            "marker",
        ],
        vec!["--url", &url, "", "--", "touch", "marker"],
        vec!["--url", &url, &long_name, "--", "touch", "marker"],
        vec![
            "--url", &url, "--lease", "0s", "bad", "--", "touch", "marker",
        ],
        vec![
            "--url", &url, "--wait", "5x", "bad", "--", "touch", "marker",
        ],
        vec![
            "--url", &url, "--grace", "soon", "bad", "--", "touch", "marker",
        ],
        vec![
            "--url",
            &url,
            "--on-lost",
            "maybe",
            "bad",
            "--",
            "touch",
            "marker",
        ],
        vec![
            "--url",
            &url,
            "--wait",
            "1s",
            "--no-wait",
            "bad",
            "--",
            "touch",
            "marker",
        ],
        vec!["--url", &url, "--bogus", "bad", "--", "touch", "marker"],
        vec!["--url", &url, "bad"],
        vec!["--url", &url, "bad", "--"],
    ];
    for args in &cases {
        let mut command = sandbox.distlock();
        command.arg("run").args(args);
        let out = finish(&mut command, SOON);
        assert_eq!(
            out.code(),
            Some(Code::Usage.as_i32()),
            "{args:?}: {:?}; stderr: {}",
            out.status,
            out.stderr
        );
        out.one_error_line();
        assert!(!sandbox.path("marker").exists(), "{args:?} ran the command");
        assert_free(&sandbox, "bad");
    }

    // A malformed URL from the environment is a usage error too.
    let mut command = sandbox.distlock();
    command
        .env("DISTLOCK_URL", "redis://h:notaport")
        .args(["run", "bad", "--", "touch", "marker"]);
    let out = finish(&mut command, SOON);
    out.expect_code(Code::Usage.as_i32()).one_error_line();

    // No subcommand; a bad name for status.
    finish(&mut sandbox.distlock(), SOON)
        .expect_code(Code::Usage.as_i32())
        .one_error_line();
    finish(&mut sandbox.status(""), SOON)
        .expect_code(Code::Usage.as_i32())
        .one_error_line();
    assert!(!sandbox.path("marker").exists());
}

#[test]
fn help_shows_the_exit_code_table() {
    let sandbox = Sandbox::new();
    let mut command = sandbox.distlock();
    command.args(["run", "--help"]);
    let out = finish(&mut command, SOON);
    out.expect_code(0);
    for code in Code::ALL {
        assert!(
            out.stdout.contains(&format!("  {} ", code.as_i32())),
            "--help lacks {code:?}: {}",
            out.stdout
        );
    }
    // What happens to what the command leaves running, and that the supervisor is not a subcommand.
    assert!(
        out.stdout
            .contains("left running in the background gets SIGTERM, then SIGKILL after --grace")
            && !out.stdout.contains("__supervise"),
        "{}",
        out.stdout
    );
}

// --- 9. status ---------------------------------------------------------------------------------

#[test]
fn status_shows_the_holder_then_free() {
    let sandbox = Sandbox::new();
    let out = finish(&mut sandbox.status("report"), SOON);
    out.expect_code(0);
    assert!(
        out.stdout.lines().any(|l| l == "state: free"),
        "{}",
        out.stdout
    );

    let holder = sandbox.hold("report");
    let out = finish(&mut sandbox.status("report"), SOON);
    out.expect_code(0);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert!(lines.contains(&"state: held"), "{}", out.stdout);
    assert!(
        lines.contains(&format!("token: {}", holder.token).as_str()),
        "{}",
        out.stdout
    );
    assert!(
        lines.contains(&format!("pid: {}", holder.pid()).as_str()),
        "{}",
        out.stdout
    );
    assert!(
        lines.iter().all(|l| l.split_once(": ").is_some()),
        "not key: value lines: {}",
        out.stdout
    );

    holder.finish();
    let out = finish(&mut sandbox.status("report"), SOON);
    out.expect_code(0);
    assert!(
        out.stdout.lines().any(|l| l == "state: free"),
        "{}",
        out.stdout
    );
}

/// `status --json`: one JSON object, the holder's token and pid in it while held, `free` after.
#[test]
fn status_json_is_one_object_with_the_holder() {
    let sandbox = Sandbox::new();
    let json = |sandbox: &Sandbox| {
        let mut command = sandbox.status("report");
        command.arg("--json");
        let out = finish(&mut command, SOON);
        out.expect_code(0);
        assert_eq!(out.stdout.lines().count(), 1, "{}", out.stdout);
        serde_json::from_str::<serde_json::Value>(&out.stdout).expect("one JSON object")
    };
    let holder = sandbox.hold("report");
    let held = json(&sandbox);
    assert_eq!(held["name"], "report");
    assert_eq!(held["backend"], "file");
    assert_eq!(held["state"], "held");
    assert_eq!(held["holder"]["token"].as_u64(), Some(holder.token));
    assert_eq!(
        held["holder"]["pid"].as_u64(),
        Some(u64::from(holder.pid()))
    );
    holder.finish();
    let free = json(&sandbox);
    assert_eq!(free["state"], "free");
    assert!(free["holder"].is_null());
}

// --- where the URL comes from -------------------------------------------------------------------

#[test]
fn the_url_comes_from_the_environment_else_the_per_user_directory() {
    let sandbox = Sandbox::new();
    // No --url, no DISTLOCK_URL: the file backend under $XDG_STATE_HOME/distlock, created.
    let mut command = sandbox.distlock();
    command.args(["run", "default", "--", "true"]);
    finish(&mut command, SOON).expect_code(0);
    assert!(sandbox.path("state/distlock").is_dir());

    // DISTLOCK_URL is used when --url is absent: a holder under it is seen as held through it.
    let holder = sandbox.hold("env");
    let mut command = sandbox.distlock();
    command
        .env("DISTLOCK_URL", sandbox.url())
        .args(["run", "--no-wait", "env", "--", "true"]);
    finish(&mut command, SOON).expect_code(Code::Busy.as_i32());
    holder.finish();
}

// --- review (file loss signal) -------------------------------------------------------------------

/// The lock directory renamed away while `distlock run` holds (no waiter anywhere): a second
/// `distlock run` of the name recreates the directory, locks a new file and runs its command while
/// the first command still runs. The first must be stopped (the lock was lost); it runs on, since
/// nothing happens to the held inode and the loss signal looks only on its events.
#[test]
fn a_renamed_lock_directory_stops_the_holders_command() {
    let sandbox = Sandbox::new();
    let mut holder = sandbox.hold("x");
    fs::rename(sandbox.path("locks"), sandbox.path("locks.old")).unwrap();
    finish(sandbox.run(&["x", "--", "touch", "second-ran"]), SOON).expect_code(0);
    assert!(sandbox.path("second-ran").exists());
    // Two commands held "x" at once; the first one's distlock must have been told.
    let status = holder.child.wait(Duration::from_secs(10));
    assert_eq!(
        status.code(),
        Some(Code::Lost.as_i32()),
        "holder exit: {status:?}"
    );
}

// --- the progress line of a long wait -----------------------------------------------------------

/// A pseudo-terminal: the master, and the slave for a child's stderr.
fn openpty() -> (fs::File, std::os::fd::OwnedFd) {
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (-1, -1);
    // Wide enough for the whole line: a narrower terminal gets it cut to its width.
    let size = libc::winsize {
        ws_row: 24,
        ws_col: 200,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two new descriptors, which are owned below.
    let done = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &size,
        )
    };
    assert_eq!(done, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are new and ours alone.
    unsafe {
        (
            fs::File::from_raw_fd(master),
            std::os::fd::OwnedFd::from_raw_fd(slave),
        )
    }
}

/// On a terminal, a wait longer than a second shows one line saying whom it waits for, rewritten in
/// place, and erases it when the lock comes; without a terminal it prints nothing extra.
#[test]
fn a_long_wait_on_a_terminal_shows_the_holder_and_erases_the_line() {
    use std::sync::{Arc, Mutex};
    let sandbox = Sandbox::new();
    let holder = sandbox.hold("shown");
    let (mut master, slave) = openpty();
    let mut on_tty = Running::spawn(
        sandbox
            .run(&["shown", "--", "true"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(slave)),
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let reader = {
        let seen = seen.clone();
        // Reads until every holder of the slave is gone (EIO).
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = master.read(&mut buf) {
                seen.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let text = || String::from_utf8_lossy(&seen.lock().unwrap()).into_owned();
    let piped = {
        let command = sandbox.run(&["shown", "--", "true"]);
        std::thread::spawn(move || finish(command, SOON))
    };
    let (pid, token) = (
        format!("pid {}", holder.pid()),
        format!("token {}", holder.token),
    );
    let named = || {
        let text = text();
        text.contains(&format!("held by {pid} on ")) && text.contains(&token)
    };
    let start = Instant::now();
    while !named() {
        assert!(
            start.elapsed() < SOON,
            "the progress line to name the holder ({pid}, {token}): {:?}",
            text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Rewritten in place: the seconds count up on one line.
    wait_until(SOON, "the line to be redrawn", || {
        text().matches("\r\x1b[Kdistlock: waiting ").count() >= 2
    });
    holder.finish();
    assert_eq!(on_tty.wait(SOON).code(), Some(0));
    reader.join().unwrap();
    let text = text();
    assert!(
        text.starts_with("\r\x1b[Kdistlock: waiting 1s for \"shown\""),
        "{text:?}"
    );
    assert!(!text.contains('\n'), "one line, rewritten: {text:?}");
    assert!(text.ends_with("\r\x1b[K"), "the line is erased: {text:?}");
    let piped = piped.join().unwrap();
    piped.expect_code(0);
    assert_eq!(piped.stderr, "", "nothing extra without a terminal");
}

// --- break ---------------------------------------------------------------------------------------

/// `distlock break` on the file backend: a `flock` cannot be taken from a live process, so it refuses
/// (69), naming the holder's pid, and the holder keeps the lock; on a free lock there is nothing to do.
#[test]
fn break_on_a_file_lock_names_the_holders_pid_and_breaks_nothing() {
    let sandbox = Sandbox::new();
    let breaking = |name: &str| {
        let mut command = sandbox.distlock();
        command
            .args(["break", "--yes", "--url"])
            .arg(sandbox.url())
            .arg(name);
        finish(command, SOON)
    };
    let free = breaking("nobody");
    free.expect_code(0);
    assert!(free.one_error_line().contains("free: nothing to break"));

    let holder = sandbox.hold("held");
    let refused = breaking("held");
    refused.expect_code(69);
    let line = refused.one_error_line();
    assert!(line.contains("cannot be broken"), "{line}");
    assert!(line.contains(&format!("pid {}", holder.pid())), "{line}");
    let busy = finish(sandbox.run(&["--no-wait", "held", "--", "true"]), SOON);
    busy.expect_code(75);
    holder.finish();
}

/// Without `--yes`, `break` asks on the terminal; with stdin not a terminal it refuses (64) before
/// touching anything.
#[test]
fn break_without_yes_and_without_a_terminal_refuses() {
    let sandbox = Sandbox::new();
    let holder = sandbox.hold("asked");
    let mut command = sandbox.distlock();
    command
        .args(["break", "--url"])
        .arg(sandbox.url())
        .arg("asked");
    let refused = finish(command, SOON);
    refused.expect_code(64);
    let line = refused.one_error_line();
    assert!(line.contains("--yes"), "{line}");
    assert!(line.contains(&format!("pid {}", holder.pid())), "{line}");
    holder.finish();
}

/// `distlock break` on Redis: asked on the terminal, "n" leaves the holder alone (75); "y" ends its
/// hold with one audit line naming it and its token; the broken `distlock run` learns it at its next
/// renewal, stops its command and exits 76, and the lock is free for the next.
#[test]
fn break_on_redis_asks_ends_the_hold_and_the_holder_stops_its_command() {
    let server = distlock_testkit::redis::RedisServer::start_or_panic();
    let sandbox = Sandbox::new();
    let url = server.url();
    let script = "echo $DISTLOCK_TOKEN > token; echo $$ > pid; sleep 60";
    let mut holder = Running::spawn(
        sandbox
            .distlock()
            .args([
                "run", "--url", &url, "--lease", "3s", "brk", "--", "sh", "-c", script,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    wait_until(SOON, "the holder's command to start", || {
        non_empty(&sandbox.path("token")) && non_empty(&sandbox.path("pid"))
    });
    let token = read_u64(&sandbox.path("token"));
    let command_pid = read_u64(&sandbox.path("pid")) as u32;

    // Asked on a terminal: the answer comes from the pty's master.
    let ask = |answer: &str| {
        let (mut master, slave) = openpty();
        let slave_err = slave.try_clone().unwrap();
        let mut command = sandbox.distlock();
        command
            .args(["break", "--url", &url, "brk"])
            .stdin(Stdio::from(slave))
            .stderr(Stdio::from(slave_err));
        let mut asking = Running::spawn(&mut command);
        drop(command);
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&seen).contains("[y/N]") {
            let n = master.read(&mut buf).unwrap();
            assert!(n > 0, "no question: {:?}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
        std::io::Write::write_all(&mut master, format!("{answer}\n").as_bytes()).unwrap();
        let status = asking.wait(SOON);
        // The rest of what it printed, up to the slave's close.
        while let Ok(n @ 1..) = master.read(&mut buf) {
            seen.extend_from_slice(&buf[..n]);
        }
        (status, String::from_utf8_lossy(&seen).into_owned())
    };
    let (declined, text) = ask("n");
    assert_eq!(declined.code(), Some(75), "{declined:?}: {text}");
    assert!(text.contains(&format!("token {token}")), "{text}");
    assert!(text.contains("not broken"), "{text}");
    assert!(is_alive(command_pid), "a declined break touched the holder");

    let (broke, text) = ask("y");
    assert_eq!(broke.code(), Some(0), "{text}");
    let audit = text
        .lines()
        .find(|l| l.starts_with("distlock: broke lock \"brk\""))
        .unwrap_or_else(|| panic!("no audit line in {text:?}"));
    assert!(audit.contains(&format!("token {token}")), "{audit}");
    assert!(audit.contains(" by ") && audit.contains(" at "), "{audit}");
    // The holder learns it at its next renewal (a third of its 3 s lease): it stops its command and
    // exits 76, well within the lease.
    let status = holder.wait(Duration::from_secs(3) + SOON);
    assert_eq!(status.code(), Some(76), "{status:?}");
    assert!(
        !is_alive(command_pid),
        "the broken holder's command still runs"
    );
    let next = finish(
        sandbox
            .distlock()
            .args(["run", "--url", &url, "--no-wait", "brk", "--", "true"]),
        SOON,
    );
    next.expect_code(0);
}
