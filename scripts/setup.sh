#!/usr/bin/env bash
# Installs what the test suite needs, only where it is missing. Idempotent: scripts/test.sh runs it
# every time, and on a machine that has everything it changes nothing and needs no network.
set -euo pipefail

# Debian packages the tests use today.
PACKAGES=(redis-server redis-tools redis-sentinel nftables etcd-server etcd-client)
# ZooKeeper (distlock-testkit/src/zookeeper.rs runs the server jar in a JVM; the Curator interop tests
# compile a Java program against the Curator jars).
PACKAGES+=(zookeeper libzookeeper-java libslf4j-java default-jre-headless default-jdk-headless
    libcurator-client-java libcurator-framework-java libcurator-recipes-java)
# Redlock's interop tests run node-redlock (npm, see below) with Node.
PACKAGES+=(nodejs)
# The Redis plain layout's interop tests run redis-py's own Lock with Debian's /usr/bin/python3.
PACKAGES+=(python3-redis)
# The SQL backend's MariaDB tests (distlock-testkit/src/mariadb.rs runs /usr/sbin/mariadbd).
PACKAGES+=(mariadb-server mariadb-client)
# PostgreSQL 15 (distlock-sql): the tests run initdb + postgres from /usr/lib/postgresql/15/bin in temp dirs.
PACKAGES+=(postgresql-15 postgresql-client-15)
# PgBouncer (distlock-sql's pooler tests): the testkit runs /usr/sbin/pgbouncer with a config of its own,
# never the system service.
PACKAGES+=(pgbouncer)

# The rest of the list in shared/reference/infra.md §9, to move into PACKAGES as the tests that need
# them land (not installed now: they cost minutes and hundreds of MiB):
#   faketime libfaketime
#   iproute2
#   gcc libc6-dev curl util-linux

log() { printf 'setup.sh: %s\n' "$*"; }
die() { printf 'setup.sh: error: %s\n' "$*" >&2; exit 1; }

installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

missing=()
for pkg in "${PACKAGES[@]}"; do
    installed "$pkg" || missing+=("$pkg")
done

if [ "${#missing[@]}" -gt 0 ]; then
    [ "$(id -u)" -eq 0 ] || die "missing packages: ${missing[*]}; run as root, or: sudo apt-get install -y --no-install-recommends ${missing[*]}"
    # Installing a server package must not start it as a service on its default port (redis on 6379,
    # ...). policy-rc.d exiting 101 tells invoke-rc.d "not now". Remove it again only if we made it.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# (No protoc: distlock-etcd's gRPC code is generated once and checked in; see crates/distlock-etcd/proto.)
for bin in redis-server redis-cli redis-sentinel etcd etcdctl node; do
    command -v "$bin" >/dev/null || die "$bin not on PATH after installing ${PACKAGES[*]}"
done
# ZooKeeper runs as a JVM the testkit starts directly; the Curator interop tests compile with javac.
for bin in java javac; do
    command -v "$bin" >/dev/null || die "$bin not on PATH after installing ${PACKAGES[*]}"
done
for jar in zookeeper slf4j-api slf4j-simple curator-client curator-framework curator-recipes; do
    [ -f "/usr/share/java/$jar.jar" ] || die "/usr/share/java/$jar.jar missing after installing ${PACKAGES[*]}"
done
# MariaDB: the testkit runs mariadb-install-db and mariadbd itself, and SQL through the mariadb client.
[ -x /usr/sbin/mariadbd ] || die "/usr/sbin/mariadbd missing after installing mariadb-server"
for bin in mariadb-install-db mariadb; do
    command -v "$bin" >/dev/null || die "$bin not on PATH after installing mariadb-server mariadb-client"
done
# PostgreSQL: the testkit runs initdb and postgres from the version's directory, SQL through psql.
for bin in /usr/lib/postgresql/15/bin/initdb /usr/lib/postgresql/15/bin/postgres /usr/lib/postgresql/15/bin/pg_isready; do
    [ -x "$bin" ] || die "$bin missing after installing postgresql-15"
done
command -v psql >/dev/null || die "psql not on PATH after installing postgresql-client-15"
[ -x /usr/sbin/pgbouncer ] || die "/usr/sbin/pgbouncer missing after installing pgbouncer"

# node-redlock (npm `redlock` v5 + ioredis) for the Redlock interop tests, pinned by its package-lock.json.
# nodesource's nodejs package carries npm; Debian's needs the separate npm package.
if ! command -v npm >/dev/null; then
    [ "$(id -u)" -eq 0 ] || die "npm not found; run as root, or: sudo apt-get install -y --no-install-recommends npm"
    log "installing npm"
    export DEBIAN_FRONTEND=noninteractive
    # The package lists may be missing or stale when no package above was missing.
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends npm
fi
NODE_REDLOCK="$(cd "$(dirname "$0")/.." && pwd)/crates/distlock-redis/tests/node-redlock"
if [ ! -d "$NODE_REDLOCK/node_modules" ]; then
    log "installing node-redlock (npm ci in $NODE_REDLOCK)"
    npm ci --prefix "$NODE_REDLOCK" --no-audit --no-fund
fi

# Rust tooling: the test runner and the two checks scripts/test.sh runs.
command -v cargo >/dev/null || die "cargo not found; install a Rust toolchain (rustup) first"
if ! cargo nextest --version >/dev/null 2>&1; then
    log "installing cargo-nextest"
    cargo install cargo-nextest --locked
fi
components=()
cargo fmt --version >/dev/null 2>&1 || components+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || components+=(clippy)
if [ "${#components[@]}" -gt 0 ]; then
    command -v rustup >/dev/null || die "missing ${components[*]} and no rustup to add them"
    log "adding rustup components ${components[*]}"
    rustup component add "${components[@]}"
fi

log "ok ($(redis-server --version | awk '{print $3}'), $(cargo nextest --version | head -n1))"
