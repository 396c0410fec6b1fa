//! The `distlock` command. Everything but logging setup lives in the library, so the tests and
//! `--help` share the one exit-code table.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

fn main() {
    // Diagnostics go to stderr; stdout is reserved for the command's own output (`status`).
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only for a person: logs and test captures get plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .try_init();
    std::process::exit(distlock_cli::main_exit_code());
}
