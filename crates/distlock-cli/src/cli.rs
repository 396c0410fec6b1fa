//! The command line: clap types, usage errors mapped to exit 64, and where the URL comes from.

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::exit::{self, Code, Failure};

/// The environment variable naming the lock service when `--url` is not given.
pub const URL_ENV: &str = "DISTLOCK_URL";

/// Distributed locks from the shell: run a command while holding a lock, like flock(1) across machines.
// clap reads this type's doc comment as the `--help` text: the example is given to rustdoc only.
#[cfg_attr(
    doc,
    doc = r#"
What `main` does first: parse, then dispatch on the [`Command`]; `Err` is already the exit code.

```
use distlock_cli::cli::{parse_from, Command};

let cli = parse_from(["distlock", "status", "-vv", "nightly"]).expect("valid arguments");
assert_eq!(cli.verbose, 2); // global: before or after the subcommand
let Command::Status(status) = cli.command else { unreachable!() };
assert_eq!(status.name, "nightly");
// A usage error is reported on stderr as one line, and is exit code 64.
assert_eq!(parse_from(["distlock", "--bogus"]).err(), Some(64));
```"#
)]
#[derive(Debug, Parser)]
#[command(name = "distlock", version, after_help = exit::help_table())]
pub struct Cli {
    /// Also print the library's log lines on stderr (-v: warnings, -vv: debug). Without it, each event
    /// is one `distlock: …` line. RUST_LOG, when set, overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
///
/// `main` dispatches on the variant; each carries its subcommand's arguments:
///
/// ```
/// use distlock_cli::cli::{parse_from, Command};
///
/// let what = |args: &[&str]| match parse_from(args.iter().copied()).expect("valid").command {
///     Command::Run(run) => format!("run {}", run.name),
///     Command::Status(status) => format!("status {}", status.name),
///     Command::Break(args) => format!("break {}", args.name),
///     Command::Bench(_) => "bench".to_string(),
///     Command::Man(man) => format!("man {}", man.subcommand.unwrap_or_default()),
///     Command::Completions(completions) => format!("completions {}", completions.shell),
/// };
/// assert_eq!(what(&["distlock", "run", "nightly", "--", "./report"]), "run nightly");
/// assert_eq!(what(&["distlock", "completions", "zsh"]), "completions zsh");
/// ```
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command while holding a lock; the command never outlives the hold.
    #[command(long_about = RUN_ABOUT)]
    Run(RunArgs),
    /// Show who holds a lock (holder, token, remaining lease, waiters where known), or "free".
    Status(StatusArgs),
    /// End another holder's hold of a lock, for a holder known to be dead whose lease is long.
    #[command(long_about = BREAK_ABOUT)]
    Break(BreakArgs),
    /// Measure a lock service: uncontended cycles, many names, one contended name, beside the
    /// engine's own round trip and a bare-client baseline.
    #[command(long_about = distlock_bench::ABOUT)]
    Bench(BenchArgs),
    /// Print the man page of distlock, or of one subcommand (roff: `distlock man > distlock.1`,
    /// `distlock man run > distlock-run.1`).
    Man(ManArgs),
    /// Print the completion script for a shell (bash: `distlock completions bash >
    /// /etc/bash_completion.d/distlock`; zsh: into a directory of $fpath as `_distlock`; fish: into
    /// ~/.config/fish/completions/distlock.fish).
    Completions(CompletionsArgs),
}

/// `distlock man`.
///
/// The page is rendered from the same clap definitions as `--help`, so it cannot drift from it:
///
/// ```
/// # fn main() -> Result<(), distlock_cli::exit::Failure> {
/// use distlock_cli::cli::{parse_from, Command};
///
/// let cli = parse_from(["distlock", "man", "run"]).expect("valid arguments");
/// let Command::Man(args) = cli.command else { unreachable!() };
/// let mut page = Vec::new();
/// distlock_cli::reference::man(args.subcommand.as_deref(), &mut page)?; // roff, section 1
/// assert!(String::from_utf8_lossy(&page).contains(".TH distlock-run 1"));
/// # Ok(()) }
/// ```
#[derive(Debug, Args)]
pub struct ManArgs {
    /// The subcommand whose page to print (run, status, bench, …); without it, distlock's own page.
    #[arg(value_name = "SUBCOMMAND")]
    pub subcommand: Option<String>,
}

/// `distlock completions`.
///
/// The shell is checked by clap (an unknown one is a usage error, 64); the script is generated from
/// the same clap definitions as `--help`:
///
/// ```
/// # fn main() -> Result<(), distlock_cli::exit::Failure> {
/// use distlock_cli::cli::{parse_from, Command};
///
/// let cli = parse_from(["distlock", "completions", "bash"]).expect("valid arguments");
/// let Command::Completions(args) = cli.command else { unreachable!() };
/// assert_eq!(args.shell, clap_complete::Shell::Bash);
/// let mut script = Vec::new();
/// distlock_cli::reference::completions(args.shell, &mut script)?;
/// assert!(String::from_utf8_lossy(&script).contains("complete -F _distlock"));
/// assert_eq!(parse_from(["distlock", "completions", "cmd.exe"]).err(), Some(64));
/// # Ok(()) }
/// ```
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_name = "SHELL")]
    pub shell: clap_complete::Shell,
}

const URL_HELP: &str = "Lock service URL (file:///dir, redis://host:port, …). Default: $DISTLOCK_URL, else \
                        file://$XDG_STATE_HOME/distlock (else ~/.local/state/distlock): per user, no server";

const RUN_ABOUT: &str = "\
Run a command while holding a lock; the command never outlives the hold.

By default the lock is NAME's mutex; --read and --write take a side of NAME's read-write lock, \
--permits N one of N permits of NAME's semaphore. The command gets DISTLOCK_NAME and DISTLOCK_TOKEN \
(the fencing token, when the backend mints one; a reader's is the last writer's), and with --permits \
DISTLOCK_PERMIT (which permit it holds), in its environment and runs in its own process group, under a small supervisor process (a child \
subreaper) that tracks every process it starts, at any depth and in any process group. Nothing it \
starts outlives the hold: if distlock dies (even by SIGKILL), the supervisor SIGKILLs them all at once \
(on file:// it holds the lock until they are gone); if the lock is lost, --on-lost decides what \
happens to them and distlock exits 76; when the command exits, whatever it left running in the \
background gets SIGTERM, then SIGKILL after --grace, and only then is the lock released. Processes \
the supervisor may not signal (one that switched user, as sudo does) are waited for. SIGINT, SIGTERM, SIGHUP and SIGQUIT \
sent to distlock are passed on to the command's process group once (signals ignored when distlock \
started stay ignored). When distlock is in the foreground of its terminal (also in a pipeline), the \
command gets the terminal and distlock's group gets it back after; with a pager after distlock in the \
pipeline, the command gets it only once it needs it, as for a password prompt. Ctrl-Z stops the whole \
job; fg resumes it. While it waits for the lock on a terminal, one line on stderr says for how long \
and who holds it (pid and host, token, for how long, lease left, where the engine tells), rewritten in \
place and erased when the lock comes; without a terminal nothing extra is printed.";

/// `distlock run`.
///
/// Durations are parsed as the user wrote them; what is not given stays `None`, for the URL or the
/// engine to decide (`--lease`: the URL's `?lease=`, else the engine's default):
///
/// ```
/// use std::time::Duration;
/// use distlock_cli::cli::{parse_from, Command, OnLost};
///
/// let cli = parse_from(["distlock", "run", "--read", "--wait", "30s", "reports", "--", "./export"])
///     .expect("valid arguments");
/// let Command::Run(run) = cli.command else { unreachable!() };
/// assert!(run.read && !run.write);
/// assert_eq!((run.wait, run.lease), (Some(Duration::from_secs(30)), None));
/// assert_eq!(run.on_lost, OnLost::Term); // the default
/// // One side at a time: --read with --write is a usage error (exit 64), before any lock is touched.
/// assert_eq!(parse_from(["distlock", "run", "--read", "--write", "x", "true"]).err(), Some(64));
/// ```
#[derive(Debug, Args)]
#[command(
    override_usage = "distlock run [OPTIONS] NAME [--] CMD [ARGS]...",
    after_help = exit::help_table()
)]
pub struct RunArgs {
    /// `--url`: the lock service (else `$DISTLOCK_URL`, else the per-user file backend).
    #[arg(long, value_name = "URL", help = URL_HELP)]
    pub url: Option<String>,
    /// Wait at most this long for the lock (500ms, 10s, 2m), then exit 124. Default: wait forever.
    #[arg(long, value_name = "DUR", value_parser = parse_duration, conflicts_with = "no_wait")]
    pub wait: Option<Duration>,
    /// Do not wait: exit 75 if the lock is held elsewhere (the same as --wait 0).
    #[arg(long)]
    pub no_wait: bool,
    /// The lease on the server, renewed every third of it while the command runs. Default: the URL's
    /// ?lease=, else the engine's own (30 s; ZooKeeper: the session timeout; etcd: the session TTL).
    #[arg(long, value_name = "DUR", value_parser = parse_duration)]
    pub lease: Option<Duration>,
    /// What to do with the command and every process it started if the lock is lost: SIGTERM (then
    /// SIGKILL after --grace), SIGKILL at once, or let it finish. distlock exits 76 in every case.
    #[arg(long, value_enum, value_name = "ACTION", default_value_t = OnLost::Term)]
    pub on_lost: OnLost,
    /// How long processes get to exit after SIGTERM before SIGKILL: the command and its descendants
    /// after a loss (--on-lost term), and what the command leaves running when it exits.
    #[arg(long, value_name = "DUR", value_parser = parse_duration, default_value = "10s")]
    pub grace: Duration,
    /// Hold the read side of NAME's read-write lock: other readers may hold it at once, no writer
    /// (as flock -s).
    #[arg(long, conflicts_with_all = ["write", "permits"])]
    pub read: bool,
    /// Hold the write side of NAME's read-write lock: no reader and no other writer (as flock -x).
    /// Where the engine keeps a name's mutex and read-write lock in one object (file://, postgres://),
    /// this is the same lock as a plain `run NAME`.
    #[arg(long, conflicts_with = "permits")]
    pub write: bool,
    /// Hold one of N permits of NAME's semaphore: at most N commands run at once. The command gets
    /// DISTLOCK_PERMIT (which permit it holds). Every user of NAME must give the same N.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=i64::from(distlock_core::MAX_PERMITS)))]
    pub permits: Option<u32>,
    /// First come, first served across machines: waiters get the lock in the order they asked for it.
    /// Redis: adds ?fair=true to the URL (a queue on the server beside the lock). etcd and ZooKeeper (zk://)
    /// queue every waiter already. Other engines: exit 64, they have no queue to join.
    #[arg(long, conflicts_with_all = ["read", "write", "permits"])]
    pub fair: bool,
    /// The lock name.
    #[arg(value_name = "NAME")]
    pub name: String,
    /// The command and its arguments (after `--` when they start with `-`).
    #[arg(value_name = "CMD", required = true, trailing_var_arg = true, num_args = 1..)]
    pub command: Vec<OsString>,
}

/// `distlock status`.
///
/// The URL is resolved when the subcommand runs, not by clap: `--url`, else `$DISTLOCK_URL`, else the
/// per-user file directory ([`lock_url`]):
///
/// ```
/// # fn main() -> Result<(), distlock_cli::exit::Failure> {
/// use distlock_cli::cli::{lock_url, parse_from, Command};
///
/// let cli = parse_from(["distlock", "status", "--url", "redis://cache:6379", "nightly"])
///     .expect("valid arguments");
/// let Command::Status(args) = cli.command else { unreachable!() };
/// assert_eq!(args.name, "nightly");
/// assert_eq!(lock_url(args.url.as_deref())?, "redis://cache:6379");
/// # Ok(()) }
/// ```
#[derive(Debug, Args)]
#[command(after_help = exit::help_table())]
pub struct StatusArgs {
    /// `--url`: the lock service (else `$DISTLOCK_URL`, else the per-user file backend).
    #[arg(long, value_name = "URL", help = URL_HELP)]
    pub url: Option<String>,
    /// Print one JSON object instead of `key: value` lines (name, backend, kind, state, holder with its
    /// token, owner, pid, host, since, held_for_ms and remaining_lease_ms, holders, last_token, waiters,
    /// nodes; a field the engine cannot tell is null, or an empty list).
    #[arg(long)]
    pub json: bool,
    /// The lock name.
    #[arg(value_name = "NAME")]
    pub name: String,
}

const BREAK_ABOUT: &str = "\
End another holder's hold of a lock: the tool for a holder known to be dead (a machine gone, a process \
stuck) whose lease or session is long. distlock shows the holder and its token and asks for \
confirmation on the terminal; --yes skips the question, and without a terminal it refuses unless --yes \
is given. Only the holder shown is broken: if another holder took the lock since, nothing is touched \
(exit 75). The holder's work may still be running, and its guard learns of the break only when its \
engine tells it or at its next renewal: that is what fencing tokens are for. Per engine: Redis and \
etcd delete the holder's key, ZooKeeper its node, PostgreSQL and MariaDB end its session; a file lock \
cannot be broken (distlock names the process holding it). One audit line (who broke which holder, \
with its token, when) goes to stderr, and to the log at warn.";

/// `distlock break`.
///
/// ```
/// use distlock_cli::cli::{parse_from, Command};
///
/// let cli = parse_from(["distlock", "break", "--yes", "nightly"]).expect("valid arguments");
/// let Command::Break(args) = cli.command else { unreachable!() };
/// assert!(args.yes && args.name == "nightly");
/// ```
#[derive(Debug, Args)]
#[command(after_help = exit::help_table())]
pub struct BreakArgs {
    /// `--url`: the lock service (else `$DISTLOCK_URL`, else the per-user file backend).
    #[arg(long, value_name = "URL", help = URL_HELP)]
    pub url: Option<String>,
    /// Do not ask: break the holder shown (needed when stdin is not a terminal).
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// The lock name.
    #[arg(value_name = "NAME")]
    pub name: String,
}

/// `distlock bench`: the flags are [`distlock_bench::Options`].
///
/// ```
/// use distlock_cli::cli::{parse_from, Command};
/// use std::time::Duration;
///
/// let args = ["distlock", "bench", "--url", "redis://cache:6379", "--duration", "2s", "--json"];
/// let cli = parse_from(args).expect("valid arguments");
/// let Command::Bench(args) = cli.command else { unreachable!() };
/// assert_eq!(args.url.as_deref(), Some("redis://cache:6379"));
/// assert_eq!(args.options.duration, Duration::from_secs(2));
/// assert!(args.options.json); // one JSON object on stdout instead of the report
/// ```
#[derive(Debug, Args)]
#[command(after_help = exit::help_table())]
pub struct BenchArgs {
    /// `--url`: the lock service (else `$DISTLOCK_URL`, else the per-user file backend).
    #[arg(long, value_name = "URL", help = URL_HELP)]
    pub url: Option<String>,
    /// The benchmark's own flags.
    #[command(flatten)]
    pub options: distlock_bench::Options,
}

/// What `run` does with the command when the lock is lost.
///
/// ```
/// use distlock_cli::cli::{parse_from, Command, OnLost};
///
/// let on_lost = |args: &[&str]| match parse_from(args.iter().copied()).expect("valid").command {
///     Command::Run(run) => run.on_lost,
///     _ => unreachable!(),
/// };
/// assert_eq!(on_lost(&["distlock", "run", "--on-lost", "kill", "job", "./work"]), OnLost::Kill);
/// // The default: SIGTERM first, SIGKILL after --grace.
/// assert_eq!(on_lost(&["distlock", "run", "job", "./work"]), OnLost::Term);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnLost {
    /// SIGTERM to every process the command started, SIGKILL after the grace.
    Term,
    /// SIGKILL to every process the command started, at once.
    Kill,
    /// Let the command run to completion (distlock still exits 76).
    Ignore,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    distlock_core::duration::parse(text).map_err(|e| e.message().to_string())
}

/// Parses the command line. `Err` carries the exit code: 0 after `--help`/`--version` (already
/// printed), 64 for every usage error (clap's own default would be 2), with the one line printed.
pub fn parse() -> Result<Cli, i32> {
    parse_from(std::env::args_os())
}

/// [`parse`] over given arguments.
pub fn parse_from<I, T>(args: I) -> Result<Cli, i32>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    use clap::error::ErrorKind as K;
    match Cli::try_parse_from(args) {
        Ok(cli) => Ok(cli),
        Err(e) if matches!(e.kind(), K::DisplayHelp | K::DisplayVersion) => {
            // Help and version go to stdout; a closed stdout is not worth a failure.
            let _ = e.print();
            Err(0)
        }
        Err(e) if e.kind() == K::DisplayHelpOnMissingArgumentOrSubcommand => {
            exit::report("missing subcommand: distlock run NAME -- CMD [ARGS…] or distlock status NAME (see distlock --help)");
            Err(Code::Usage.as_i32())
        }
        Err(e) => {
            exit::report(format_args!("{} (see distlock --help)", clap_message(&e)));
            Err(Code::Usage.as_i32())
        }
    }
}

/// clap's error without the `error:` prefix, tips and usage: its first paragraph, as one line.
fn clap_message(error: &clap::Error) -> String {
    let rendered = error.render().to_string();
    let paragraph: Vec<&str> = rendered
        .lines()
        .map(str::trim)
        .skip_while(|l| l.is_empty())
        .take_while(|l| !l.is_empty())
        .collect();
    let text = paragraph.join(" ");
    text.strip_prefix("error:")
        .map_or(text.clone(), |t| t.trim().to_string())
}

/// `url` with fair mode asked for (`distlock run --fair`): Redis URLs get `fair=true`; etcd and
/// ZooKeeper ones are returned as they are (their waiters queue in arrival order already); any other
/// engine, or a Redis URL that says `fair=false`, is a usage error.
///
/// ```
/// use distlock_cli::cli::fair_url;
/// assert_eq!(fair_url("redis://h:6379").ok().as_deref(), Some("redis://h:6379?fair=true"));
/// assert_eq!(fair_url("redis://h?lease=5s").ok().as_deref(), Some("redis://h?lease=5s&fair=true"));
/// assert_eq!(fair_url("redis://h?fair=true").ok().as_deref(), Some("redis://h?fair=true"));
/// assert_eq!(fair_url("etcd://h:2379").ok().as_deref(), Some("etcd://h:2379"));
/// assert!(fair_url("redis://h?fair=false").is_err());
/// assert!(fair_url("file:///tmp/locks").is_err());
/// assert!(fair_url("redlock://a,b,c").is_err());
/// ```
pub fn fair_url(url: &str) -> Result<String, Failure> {
    let parsed = distlock_core::url::LockUrl::parse(url)?;
    let refuse = |why: &str| Err(Failure::new(Code::Usage, format!("--fair: {why}")));
    match parsed.scheme() {
        "etcd" | "etcds" | "zk" | "zks" => Ok(url.to_string()),
        "redis" | "rediss" | "redis+sentinel" | "redis+cluster" => match parsed.query("fair") {
            Some("true") => Ok(url.to_string()),
            Some(other) => refuse(&format!(
                "the URL already says fair={other}; drop one of the two"
            )),
            None if url.contains('?') => Ok(format!("{url}&fair=true")),
            None => Ok(format!("{url}?fair=true")),
        },
        other => refuse(&format!(
            "{other}:// has no queue of waiters to join (fair mode exists for redis://, and etcd:// and zk:// queue every waiter already)"
        )),
    }
}

/// The URL to use: `--url`, else `$DISTLOCK_URL` (empty counts as unset), else the per-user file
/// directory, created (mode 0700) if missing.
pub fn lock_url(explicit: Option<&str>) -> Result<String, Failure> {
    if let Some(url) = explicit {
        return Ok(url.to_string());
    }
    if let Some(url) = std::env::var_os(URL_ENV).filter(|v| !v.is_empty()) {
        return url
            .into_string()
            .map_err(|_| Failure::new(Code::Usage, format!("${URL_ENV} is not valid UTF-8")));
    }
    let dir = distlock::default_file_dir();
    create_private_dir(&dir).map_err(|e| {
        Failure::new(
            Code::Unavailable,
            format!(
                "cannot create the default lock directory {}: {e}; pass --url or set ${URL_ENV}",
                dir.display()
            ),
        )
    })?;
    file_url(&dir)
}

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// `file://` + the path, with the characters the URL grammar reads (`%`, `?`) escaped.
fn file_url(dir: &Path) -> Result<String, Failure> {
    let path = dir.to_str().ok_or_else(|| {
        Failure::new(
            Code::Usage,
            format!(
                "the default lock directory {} is not valid UTF-8; pass --url",
                dir.display()
            ),
        )
    })?;
    let escaped = path.replace('%', "%25").replace('?', "%3F");
    Ok(format!("file://{escaped}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_defaults() {
        let Ok(cli) = parse_from(["distlock", "run", "--wait", "500ms", "n", "--", "true"]) else {
            panic!("should parse")
        };
        let Command::Run(run) = cli.command else {
            panic!("run")
        };
        assert_eq!(run.wait, Some(Duration::from_millis(500)));
        assert_eq!(run.lease, None);
        assert_eq!(run.grace, Duration::from_secs(10));
        assert_eq!(run.on_lost, OnLost::Term);
        assert_eq!(run.command, ["true"]);
    }

    #[test]
    fn command_flags_are_not_ours() {
        let Ok(cli) = parse_from(["distlock", "run", "n", "sh", "-c", "--lease"]) else {
            panic!("should parse")
        };
        let Command::Run(run) = cli.command else {
            panic!("run")
        };
        assert_eq!(run.command, ["sh", "-c", "--lease"]);
        assert_eq!(run.lease, None);
    }

    #[test]
    fn usage_errors_exit_64() {
        assert_eq!(parse_from(["distlock", "run", "n"]).err(), Some(64));
        assert_eq!(
            parse_from(["distlock", "run", "--wait", "5x", "n", "true"]).err(),
            Some(64)
        );
        assert_eq!(
            parse_from(["distlock", "run", "--wait", "1s", "--no-wait", "n", "true"]).err(),
            Some(64)
        );
        assert_eq!(parse_from(["distlock"]).err(), Some(64));
    }

    #[test]
    fn file_urls_escape_what_the_grammar_reads() {
        assert_eq!(
            file_url(Path::new("/a b/%x?y")).ok().as_deref(),
            Some("file:///a b/%25x%3Fy")
        );
    }
}
