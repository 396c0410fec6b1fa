//! The `distlock` command-line tool: `distlock run NAME -- CMD…` runs a command while holding a lock
//! (like flock(1), across machines); `distlock status NAME` shows who holds it; `distlock bench`
//! measures a lock service; `distlock man` and `distlock completions SHELL` print the man pages and
//! completion scripts.
//!
//! The binary is a thin `main`; this library holds the command so its pieces (the exit-code table,
//! argument parsing) can be tested and shown in `--help` from one place.

//!
//! ```
//! use distlock_cli::cli::{parse_from, Command};
//!
//! let cli = parse_from(["distlock", "run", "--permits", "4", "encoder", "--", "./encode"])
//!     .expect("valid arguments");
//! let Command::Run(run) = cli.command else { unreachable!() };
//! assert_eq!((run.name.as_str(), run.permits), ("encoder", Some(4)));
//! // Usage errors are exit code 64, reported on stderr as one line.
//! assert_eq!(parse_from(["distlock", "run", "--permits", "0", "x", "true"]).err(), Some(64));
//! ```
#![deny(missing_docs)]
pub mod bench;
pub mod breaking;
pub mod child;
pub mod cli;
pub mod exit;
pub mod progress;
pub mod reference;
pub mod run;
pub mod status;
pub mod supervisor;

/// Parses the command line, runs the subcommand, and returns the process exit code. Usage errors and
/// failures have already been reported on stderr as one line.
pub fn main_exit_code() -> i32 {
    // `distlock run` re-executes this binary as the command's supervisor (hidden from `--help`).
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == supervisor::SUBCOMMAND) {
        return supervisor::main(&args[2..]);
    }
    let cli = match cli::parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    init_logging(cli.verbose);
    // One thread is plenty: the work is waiting. The command's supervisor notices distlock's death by
    // its control socket closing, not by a parent-death signal, so the forking thread does not matter.
    // The benchmark gets the runtime shape its peers were measured with.
    let mut builder = match cli.command {
        cli::Command::Bench(_) => bench::runtime_builder(),
        _ => tokio::runtime::Builder::new_current_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            exit::report(format_args!("cannot start the async runtime: {e}"));
            return exit::Code::Unavailable.as_i32();
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            cli::Command::Run(args) => run::run(args).await,
            cli::Command::Status(args) => status::status(args).await,
            cli::Command::Break(args) => breaking::break_lock(args).await,
            cli::Command::Bench(args) => bench::bench(args).await,
            cli::Command::Man(args) => {
                reference::man(args.subcommand.as_deref(), &mut std::io::stdout().lock())
                    .map(|()| 0)
            }
            cli::Command::Completions(args) => {
                reference::completions(args.shell, &mut std::io::stdout().lock()).map(|()| 0)
            }
        }
    });
    // Nothing is left to finish (the lock was released explicitly); do not wait for stray blocking
    // threads.
    runtime.shutdown_background();
    match result {
        Ok(code) => code,
        Err(failure) => {
            exit::report(&failure);
            failure.code().as_i32()
        }
    }
}

/// Log lines go to stderr, and only with `-v` (or `RUST_LOG`): without it every event is reported once,
/// as the one `distlock: …` line of [`exit::report`], not also as a log line.
fn init_logging(verbose: u8) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let level = match verbose {
        0 => "error",
        1 => "warn",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        // stdout is reserved for the command's own output (`status`).
        .with_writer(std::io::stderr)
        // Colour only for a person: logs and test captures get plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .try_init();
}
