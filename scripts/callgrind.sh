#!/usr/bin/env bash
# Instructions per uncontended cycle, distlock beside its bare loop, counted by valgrind's callgrind:
# a count that is the same whatever else the machine is doing (issue 9; `perf stat -e instructions`
# needs hardware counters this machine does not expose).
#
#   scripts/callgrind.sh [N1 N2]        (default 1000 3000 cycles; file:// uses a fifth of each)
#
# For Redis (a redis-server this script starts on a free loopback port, no persistence, stopped by its
# PID at the end) and for file:// (a temporary directory), it runs `distlock bench --workload
# uncontended --cycles N --only distlock|baselines` under callgrind twice, with N1 and N2 measured
# cycles, and prints (I(N2) − I(N1)) / (N2 − N1): start-up, connecting and the warm-up cancel out.
# `--only baselines` runs the first baseline alone: the bare SET NX PX + EVALSHA loop on Redis, the
# bare flock + write + fdatasync + unlock floor on file. The Redis server runs under callgrind too
# (a fresh one per run, shut down with SHUTDOWN NOSAVE so its counts are written), giving the server's
# instructions per cycle beside the client's.
#
# Needs valgrind, redis-server and redis-cli. The binary is a release build of the CLI with rustix's
# libc backend, in its own target dir (target/callgrind): valgrind cannot follow rustix's own vDSO
# lookup (the process dies with SIGSEGV in rustix::backend::param::auxv::check_elf_base at the first
# clock read, rustix issue #1559), while glibc's clock_gettime it handles. The first run builds it (a
# full release build, ~10 min); BIN= names another binary built the same way. The counts take a few
# minutes more.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

n1=${1:-1000}
n2=${2:-3000}
if [ -z "${BIN:-}" ]; then
    RUSTFLAGS="--cfg rustix_use_libc" cargo build --release -p distlock-cli \
        --target-dir target/callgrind >&2
fi
bin=${BIN:-target/callgrind/release/distlock}
[ -x "$bin" ] || { echo "no $bin" >&2; exit 1; }
for tool in valgrind redis-server redis-cli; do
    command -v "$tool" >/dev/null || { echo "$tool is not installed" >&2; exit 1; }
done

work=$(mktemp -d)
server_pid=
cleanup() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

free_port() {
    local port
    for port in $(shuf -i 20000-60000 -n 50); do
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return
        fi
    done
    echo "no free port" >&2
    return 1
}

# The instructions (Ir) callgrind collected, from its log.
collected() {
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$1" | tail -1
}

# Starts redis-server under callgrind on a free port; sets $port and $server_pid.
start_server() {
    port=$(free_port)
    valgrind --tool=callgrind --callgrind-out-file=/dev/null --log-file="$work/server.log" \
        redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
        >/dev/null 2>&1 &
    server_pid=$!
    # Under valgrind on a loaded shared machine the start can take well over 20 s.
    for _ in $(seq 1 1200); do
        redis-cli -p "$port" ping >/dev/null 2>&1 && return
        kill -0 "$server_pid" 2>/dev/null || break
        sleep 0.1
    done
    echo "redis-server under callgrind did not start:" >&2
    tail -n 20 "$work/server.log" >&2 || true
    return 1
}

stop_server() {
    redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=
}

# count URL ONLY N: the client's instructions (and the server's, for Redis, in $server_ir).
count() {
    local url=$1 only=$2 n=$3
    valgrind --tool=callgrind --callgrind-out-file=/dev/null --log-file="$work/client.log" \
        "$bin" bench --url "$url" --workload uncontended --cycles "$n" --only "$only" \
        --duration 60s --json >"$work/report.json" 2>"$work/stderr" \
        || { cat "$work/stderr" "$work/client.log" >&2; return 1; }
    collected "$work/client.log"
}

per_cycle() { # I1 I2
    awk -v a="$1" -v b="$2" -v n1="$n1x" -v n2="$n2x" 'BEGIN { printf "%.0f", (b - a) / (n2 - n1) }'
}

printf '%-8s %-44s %16s %16s\n' engine loop "client instr/cycle" "server instr/cycle"
declare -A client server
for engine in redis file; do
    if [ "$engine" = redis ]; then n1x=$n1 n2x=$n2; else n1x=$((n1 / 5)) n2x=$((n2 / 5)); fi
    for only in distlock baselines; do
        declare -a c=() s=()
        for n in "$n1x" "$n2x"; do
            if [ "$engine" = redis ]; then
                start_server
                c+=("$(count "redis://127.0.0.1:$port" "$only" "$n")")
                stop_server
                s+=("$(collected "$work/server.log")")
            else
                rm -rf "$work/locks"
                mkdir "$work/locks"
                c+=("$(count "file://$work/locks" "$only" "$n")")

            fi
        done
        label=$(sed -n 's/.*"label": "\(.*\)".*/\1/p' "$work/report.json" | head -1)
        client[$engine/$only]=$(per_cycle "${c[0]}" "${c[1]}")
        if [ "$engine" = redis ]; then
            server[$engine/$only]=$(per_cycle "${s[0]}" "${s[1]}")
        else
            server[$engine/$only]="-"
        fi
        printf '%-8s %-44s %16s %16s\n' "$engine" "$label" "${client[$engine/$only]}" \
            "${server[$engine/$only]}"
    done
    awk -v d="${client[$engine/distlock]}" -v b="${client[$engine/baselines]}" \
        'BEGIN { if (b > 0) printf "         distlock / bare loop, client instructions: %.2f×\n", d / b }'
    if [ "$engine" = redis ]; then
        awk -v dc="${client[redis/distlock]}" -v ds="${server[redis/distlock]}" \
            -v bc="${client[redis/baselines]}" -v bs="${server[redis/baselines]}" \
            'BEGIN { if (bs > 0) printf "         distlock / bare loop, server instructions: %.2f×; client + server: %.2f×\n", ds / bs, (dc + ds) / (bc + bs) }'
    fi
done
echo "(N = $n1 and $n2 measured cycles on Redis, $((n1 / 5)) and $((n2 / 5)) on file; per cycle = ΔI / ΔN;"
echo " user-space instructions only: callgrind does not see the kernel's work, syscalls and fdatasync included)"
