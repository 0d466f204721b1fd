#!/usr/bin/env bash
# Throwaway PostgreSQL clusters for tests.
#
#   postgres.sh install               install Debian's server package when no server is found
#   postgres.sh start DIR PORT        initdb DIR/data (once), start on 127.0.0.1:PORT, wait until ready
#   postgres.sh stop DIR              stop the server whose PID is in DIR/data/postmaster.pid
#   postgres.sh bindir                print the folder of initdb, pg_ctl and postgres
#
# PostgreSQL refuses to run as root, so as root the cluster belongs to the `postgres` user (made
# by the Debian package) and DIR must be reachable by that user (e.g. a fresh folder in /tmp).
# With POSTGRES_PASSWORD set, the superuser `postgres` needs it over TCP; else TCP is trusted.
# The Unix socket goes in DIR itself, so nothing is written to /var/run/postgresql.
# PG_BINDIR overrides where the server binaries are looked for.
set -euo pipefail

die() { echo "postgres.sh: $*" >&2; exit 1; }

# Dies with the last lines of a log file (the caller may delete the file).
die_with_log() { tail -n 20 "$2" >&2 || true; die "$1 (log: $2)"; }

is_root() { [ "$(id -u)" = 0 ]; }

bindir() {
  if [ -n "${PG_BINDIR:-}" ]; then echo "$PG_BINDIR"; return 0; fi
  local found
  found=$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  if [ -n "$found" ] && [ -x "$found/postgres" ]; then echo "$found"; return 0; fi
  if command -v postgres >/dev/null 2>&1; then dirname "$(command -v postgres)"; return 0; fi
  return 1
}

install() {
  if bindir >/dev/null; then return 0; fi
  is_root || die "the PostgreSQL server is not installed; as root run: $0 install"
  # Keep apt from starting the distribution's default cluster: tests start their own.
  local policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends postgresql || die "apt-get install postgresql failed"
  bindir >/dev/null || die "postgresql is installed but no server binary was found"
}

# Runs a command as the cluster's owner: `postgres` when we are root, else ourselves.
as_owner() {
  if is_root; then runuser -u postgres -- "$@"; else "$@"; fi
}

start() {
  local dir=$1 port=$2 password=${POSTGRES_PASSWORD:-}
  local bin data="$dir/data"
  bin=$(bindir) || die "the PostgreSQL server is not installed (run: $0 install)"
  mkdir -p "$dir"
  if is_root; then chown postgres: "$dir"; fi
  if [ ! -f "$data/PG_VERSION" ]; then
    local auth=(--auth=trust)
    if [ -n "$password" ]; then
      (umask 077; printf '%s\n' "$password" > "$dir/.pwfile")
      if is_root; then chown postgres: "$dir/.pwfile"; fi
      auth=(--auth-local=trust --auth-host=scram-sha-256 --pwfile="$dir/.pwfile")
    fi
    if ! as_owner "$bin/initdb" -D "$data" -U postgres -E UTF8 --locale=C.UTF-8 --no-sync \
        "${auth[@]}" > "$dir/initdb.log" 2>&1; then
      rm -f "$dir/.pwfile"
      die_with_log "initdb failed" "$dir/initdb.log"
    fi
    rm -f "$dir/.pwfile"
  fi
  local options="-c listen_addresses=127.0.0.1 -p $port -k $dir"
  options+=" -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
  as_owner "$bin/pg_ctl" -D "$data" -l "$dir/postgres.log" -w -t 60 -o "$options" start \
    > /dev/null || die_with_log "the server did not start" "$dir/postgres.log"
  echo "postgres.sh: ready on 127.0.0.1:$port (pid $(head -n 1 "$data/postmaster.pid"))"
}

stop() {
  local pidfile="$1/data/postmaster.pid" pid
  [ -f "$pidfile" ] || return 0
  pid=$(head -n 1 "$pidfile")
  kill -INT "$pid" 2>/dev/null || return 0  # fast shutdown: ends open sessions
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -QUIT "$pid" 2>/dev/null || true  # immediate shutdown
}

case "${1:-}" in
  install) install ;;
  start) [ $# -eq 3 ] || die "usage: $0 start DIR PORT"; start "$2" "$3" ;;
  stop) [ $# -eq 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
  bindir) bindir || die "the PostgreSQL server is not installed" ;;
  *) die "usage: $0 install | start DIR PORT | stop DIR | bindir" ;;
esac
