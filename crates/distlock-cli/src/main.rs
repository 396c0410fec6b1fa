//! The `distlock` command. Everything lives in the library, so the tests and `--help` share the one
//! exit-code table.

fn main() {
    std::process::exit(distlock_cli::main_exit_code());
}
