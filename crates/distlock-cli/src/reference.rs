//! What the command says about itself, all from the one set of clap definitions in [`crate::cli`]:
//! the man pages (`distlock man [SUBCOMMAND]`, with `clap_mangen`), shell completions
//! (`distlock completions SHELL`, with `clap_complete`) and `docs/cli.md` ([`cli_markdown`], which a
//! test keeps equal to the file), so none of them can drift from `--help`.

use std::io::{self, Write};

use clap::CommandFactory;

use crate::cli::Cli;
use crate::exit::{Code, Failure};

/// The file [`cli_markdown`] is kept in, from the workspace root.
pub const CLI_DOC: &str = "docs/cli.md";

/// The command tree as clap sees it, built (help and version flags added, as `--help` shows them).
fn command() -> clap::Command {
    let mut cmd = Cli::command();
    cmd.build();
    cmd
}

/// The subcommands a page is written for, in `--help` order (hidden ones and clap's `help` left out).
fn subcommands(cmd: &clap::Command) -> impl Iterator<Item = &clap::Command> {
    cmd.get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
}

/// Writes the man page of `distlock` (no `subcommand`) or of `distlock SUBCOMMAND` (roff, section 1)
/// to `out`. An unknown subcommand is a usage error naming the known ones.
pub fn man(subcommand: Option<&str>, out: &mut dyn Write) -> Result<(), Failure> {
    let cmd = command();
    let page = match subcommand {
        None => cmd,
        Some(name) => {
            let Some(sub) = subcommands(&cmd).find(|s| s.get_name() == name).cloned() else {
                let known: Vec<&str> = subcommands(&cmd).map(clap::Command::get_name).collect();
                return Err(Failure::new(
                    Code::Usage,
                    format!(
                        "no man page for {name:?}: the subcommands are {}",
                        known.join(", ")
                    ),
                ));
            };
            // `distlock-run(1)`, as git and cargo name their subcommands' pages.
            let title = format!("distlock-{name}");
            sub.name(title.clone())
                .bin_name(title)
                .version(env!("CARGO_PKG_VERSION"))
        }
    };
    clap_mangen::Man::new(page).render(out).or_else(written)
}

/// Writes the completion script of `shell` for `distlock` to `out`.
pub fn completions(shell: clap_complete::Shell, out: &mut dyn Write) -> Result<(), Failure> {
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "distlock", out);
    out.flush().or_else(written)
}

/// `docs/cli.md`: every subcommand's full `--help`, as the binary prints it (wrapped at 100 columns,
/// for reading on a page).
pub fn cli_markdown() -> String {
    let mut cmd = command().term_width(100);
    let mut page = String::from(
        "# The `distlock` command\n\n\
         <!-- Generated from the clap definitions in crates/distlock-cli/src/cli.rs: do not edit by hand. \
         After changing a flag or a help text, run\n\
         UPDATE_CLI_DOC=1 cargo nextest run -p distlock-cli -E 'test(cli_reference)'\n\
         (the test fails while this file and `distlock --help` differ). -->\n\n\
         The same text is in `distlock help [SUBCOMMAND]`, in the man pages (`distlock man > distlock.1`, \
         `distlock man run > distlock-run.1`) and, for flag names, in the shell completions \
         (`distlock completions bash|zsh|fish|elvish|powershell`).\n\n",
    );
    let names: Vec<String> = subcommands(&cmd)
        .map(|s| s.get_name().to_string())
        .collect();
    page.push_str("Subcommands:");
    for name in &names {
        page.push_str(&format!(" [`{name}`](#distlock-{name})"));
    }
    page.push_str("\n\n## distlock\n\n```text\n");
    page.push_str(&plain(&cmd.render_long_help().to_string()));
    page.push_str("```\n");
    for name in &names {
        let Some(sub) = cmd.find_subcommand_mut(name) else {
            continue;
        };
        let mut sub = sub.clone().bin_name(format!("distlock {name}"));
        page.push_str(&format!("\n## distlock {name}\n\n```text\n"));
        page.push_str(&plain(&sub.render_long_help().to_string()));
        page.push_str("```\n");
    }
    page
}

/// Help text with its trailing spaces trimmed and one final newline.
fn plain(text: &str) -> String {
    let mut out: String = text
        .lines()
        .map(|l| format!("{}\n", l.trim_end()))
        .collect();
    while out.ends_with("\n\n") {
        out.pop();
    }
    out
}

/// A reader that stopped reading (`distlock man | head`) is no failure; any other write error is.
fn written(e: io::Error) -> Result<(), Failure> {
    if e.kind() == io::ErrorKind::BrokenPipe {
        return Ok(());
    }
    Err(Failure::new(
        Code::Unavailable,
        format!("cannot write the output: {e}"),
    ))
}
