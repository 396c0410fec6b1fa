#!/usr/bin/env bash
# What CI runs (.ci/run) and what a developer runs before pushing: setup, then formatting, the whole
# workspace's tests against real servers (one nextest run), doctests, clippy and the API docs. Every
# step runs even if an earlier one failed, so one run reports everything; the exit status is non-zero
# if any failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh

profile=default
if [ -n "${CI:-}" ]; then
    profile=ci
    # A clean clone builds everything once: incremental compilation's caches would only be written,
    # never read (about a tenth of the build's time on 2 cores).
    export CARGO_INCREMENTAL=0
fi

failed=()
step() {
    local name=$1
    shift
    printf '\n==> %s: %s\n' "$name" "$*"
    local start=$SECONDS
    if "$@"; then
        printf '==> %s: ok (%ss)\n' "$name" "$((SECONDS - start))"
    else
        printf '==> %s: FAILED (%ss)\n' "$name" "$((SECONDS - start))"
        failed+=("$name")
    fi
}

# The README's first command, verbatim, on a machine with nothing but a Rust toolchain: built in its
# own target dir with no protoc on PATH (a dir of links to every other program) and PROTOC unset.
first_command() {
    local bin_dir
    bin_dir=$(mktemp -d)
    local dir prog
    local IFS=:
    for dir in $PATH; do
        [ -d "$dir" ] || continue
        for prog in "$dir"/*; do
            [ -f "$prog" ] && [ -x "$prog" ] || continue
            [ "${prog##*/}" = protoc ] && continue
            [ -e "$bin_dir/${prog##*/}" ] || ln -s "$prog" "$bin_dir/${prog##*/}"
        done
    done
    unset IFS
    local command
    command=$(grep -m1 '^cargo run -q -p distlock-cli -- run ' README.md) || {
        echo "first-command: no 'cargo run -q -p distlock-cli -- run' line in README.md" >&2
        rm -rf "$bin_dir"
        return 1
    }
    echo "first-command: $command"
    local out status=0
    out=$(env -u PROTOC PATH="$bin_dir" CARGO_TARGET_DIR=target/first-command bash -c "$command" 2>&1) || status=$?
    rm -rf "$bin_dir"
    printf '%s\n' "$out"
    [ "$status" -eq 0 ] || { echo "first-command: exited $status" >&2; return 1; }
    case $out in
        *"I hold nightly-report with token "*) ;;
        *) echo "first-command: the command's output is missing" >&2; return 1 ;;
    esac
}

step fmt cargo fmt --all -- --check
step first-command first_command
step tests cargo nextest run --workspace --all-features --no-fail-fast --profile "$profile"
step doctests cargo test --workspace --doc --all-features
# The example, as `cargo run -p distlock --example basic` runs it, from the test step's build (the same
# features: `-p distlock` alone unifies features afresh and rebuilds much of the tree, 80 s).
run_example() {
    local exe
    exe=$(cargo build -q --workspace --all-features --example basic --message-format=json |
        grep -o '"executable":"[^"]*"' | head -1 | cut -d'"' -f4)
    [ -n "$exe" ] || { echo "examples: cargo named no executable for the example" >&2; return 1; }
    "$exe"
}

step examples run_example
step clippy cargo clippy --workspace --all-targets --all-features -- -D warnings
# The API docs build without a warning (a broken or private link, a missing doc on a published crate).
step docs env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features --lib

echo
if [ "${#failed[@]}" -eq 0 ]; then
    echo "test.sh: ALL PASSED (fmt, first-command, tests, doctests, examples, clippy, docs) in ${SECONDS}s"
else
    echo "test.sh: FAILED: ${failed[*]} (after ${SECONDS}s)"
    exit 1
fi
