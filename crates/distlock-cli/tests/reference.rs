//! The generated references: `docs/cli.md` equals what the clap definitions give, `distlock man` prints
//! roff pages that carry every flag, and `distlock completions` prints scripts their shells accept.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_distlock");

fn distlock(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().unwrap()
}

#[test]
fn cli_reference_is_the_generated_one() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(distlock_cli::reference::CLI_DOC);
    let generated = distlock_cli::reference::cli_markdown();
    if std::env::var_os("UPDATE_CLI_DOC").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "{} is not what the clap definitions give (a flag or help text changed): run \
         UPDATE_CLI_DOC=1 cargo nextest run -p distlock-cli -E 'test(cli_reference)' and commit it",
        path.display()
    );
    // Every subcommand and the flags users look for are in it.
    for needle in [
        "## distlock run",
        "## distlock status",
        "## distlock bench",
        "--permits <N>",
        "--on-lost <ACTION>",
    ] {
        assert!(generated.contains(needle), "{needle:?} missing");
    }
}

#[test]
fn man_prints_roff_pages_for_distlock_and_each_subcommand() {
    let top = distlock(&["man"]);
    assert!(top.status.success(), "{top:?}");
    let top = String::from_utf8(top.stdout).unwrap();
    assert!(top.contains(".TH distlock 1"), "{top}");
    for sub in ["run", "status", "bench", "man", "completions"] {
        assert!(top.contains(sub), "the top page lists {sub}");
    }
    let run = distlock(&["man", "run"]);
    assert!(run.status.success(), "{run:?}");
    let run = String::from_utf8(run.stdout).unwrap();
    assert!(run.contains(".TH distlock-run 1"), "{run}");
    assert!(run.contains("permits"), "{run}");
    assert!(
        run.contains("DISTLOCK_TOKEN"),
        "the long help is on the page"
    );
    let unknown = distlock(&["man", "nope"]);
    assert_eq!(unknown.status.code(), Some(64), "{unknown:?}");
    let said = String::from_utf8(unknown.stderr).unwrap();
    assert!(
        said.contains("\"nope\"") && said.contains("run, status"),
        "{said}"
    );
}

#[test]
fn completions_are_scripts_their_shells_accept() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = distlock(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8(out.stdout).unwrap();
        assert!(
            script.contains("permits"),
            "{shell}: no --permits in {script}"
        );
        assert!(script.contains("on-lost"), "{shell}: no --on-lost");
    }
    // bash is on every machine the tests run on: its parser must accept the script.
    let script = distlock(&["completions", "bash"]).stdout;
    let mut check = Command::new("bash")
        .args(["-n"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check.stdin.take().unwrap().write_all(&script).unwrap();
    let checked = check.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "bash -n: {}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let unknown = distlock(&["completions", "tcsh"]);
    assert_eq!(unknown.status.code(), Some(64), "{unknown:?}");
}
