#!/usr/bin/env bash
# What CI runs (.ci/run) and what a developer runs before pushing: setup, then formatting, the whole
# workspace's tests against real servers (one nextest run), doctests, and clippy. Every step runs
# even if an earlier one failed, so one run reports everything; the exit status is non-zero if any failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh

profile=default
[ -n "${CI:-}" ] && profile=ci

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

step fmt cargo fmt --all -- --check
step tests cargo nextest run --workspace --all-features --no-fail-fast --profile "$profile"
step doctests cargo test --workspace --doc --all-features
step examples cargo run -q -p distlock --all-features --example basic
step clippy cargo clippy --workspace --all-targets --all-features -- -D warnings

echo
if [ "${#failed[@]}" -eq 0 ]; then
    echo "test.sh: ALL PASSED (fmt, tests, doctests, examples, clippy) in ${SECONDS}s"
else
    echo "test.sh: FAILED: ${failed[*]} (after ${SECONDS}s)"
    exit 1
fi
