# Sourced by scripts/test: start / stop a private Redis and PostgreSQL on loopback, and export
# HIGGS_TEST_REDIS_URL and HIGGS_TEST_POSTGRES_URL for the tests.
#
# Runs as any user when redis-server and PostgreSQL (initdb, pg_ctl, pg_isready) are installed:
# the cluster then belongs to the user who runs it. Only root on a Debian-like system (apt-get)
# installs what is missing; anyone else gets one line naming it and a non-zero status.

SERVICES_DIR=${SERVICES_DIR:-$(mktemp -d /tmp/higgs-services.XXXXXX)}
REDIS_PORT=${REDIS_PORT:-6391}
PG_PORT=${PG_PORT:-5441}

_is_root() { [ "$(id -u)" = 0 ]; }

_pg_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do [ -x "$d/initdb" ] && { echo "$d"; return 0; }; done
  d=$(command -v initdb 2>/dev/null) && { dirname "$d"; return 0; }
  return 1
}

_missing() {
  local missing=()
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
  _pg_bin >/dev/null 2>&1 || missing+=(postgresql)
  echo "${missing[*]}"
}

services_install() {
  local missing; missing=$(_missing)
  [ -z "$missing" ] && return 0
  if _is_root && command -v apt-get >/dev/null 2>&1; then
    echo "services: installing $missing from Debian packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    # shellcheck disable=SC2086
    apt-get install -y -q $missing >/dev/null
  else
    echo "services: missing $missing; install them (e.g. apt-get install $missing) or run this as root on Debian" >&2
    return 1
  fi
}

# The cluster owner: initdb refuses to run as root, so root hands the cluster to a `postgres`
# user; anyone else owns it themselves.
_pg_user() { if _is_root; then echo postgres; else id -un; fi; }

_as_pg() {
  if _is_root; then su postgres -s /bin/sh -c "$1"; else sh -c "$1"; fi
}

services_start() {
  services_install || return 1
  chmod 755 "$SERVICES_DIR"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
    --daemonize yes --dir "$SERVICES_DIR" --logfile "$SERVICES_DIR/redis.log" \
    --pidfile "$SERVICES_DIR/redis.pid"
  local pgbin; pgbin=$(_pg_bin)
  mkdir -p "$SERVICES_DIR/pg"
  if _is_root; then
    id postgres >/dev/null 2>&1 || useradd -r -m postgres
    chown postgres "$SERVICES_DIR/pg"
  fi
  _as_pg "'$pgbin/initdb' -D '$SERVICES_DIR/pg/data' -U postgres --auth=trust >'$SERVICES_DIR/pg/initdb.log' 2>&1" \
    || { cat "$SERVICES_DIR/pg/initdb.log" >&2; return 1; }
  _as_pg "'$pgbin/pg_ctl' -D '$SERVICES_DIR/pg/data' -w -t 300 -l '$SERVICES_DIR/pg/server.log' \
    -o \"-p $PG_PORT -k '$SERVICES_DIR/pg' -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off\" start >/dev/null"
  for _ in $(seq 1 600); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1
  done
  for _ in $(seq 1 600); do
    "$pgbin/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" && break; sleep 0.2
  done
  "$pgbin/pg_isready" -h 127.0.0.1 -p "$PG_PORT" >/dev/null || { cat "$SERVICES_DIR/pg/server.log" >&2; return 1; }
  export HIGGS_TEST_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
  export HIGGS_TEST_POSTGRES_URL="postgresql+psycopg://postgres@127.0.0.1:$PG_PORT/postgres"
  echo "services: redis on 127.0.0.1:$REDIS_PORT, postgresql on 127.0.0.1:$PG_PORT as $(_pg_user) ($SERVICES_DIR)"
}

services_stop() {
  local pgbin; pgbin=$(_pg_bin) || true
  if [ -n "$pgbin" ] && [ -f "$SERVICES_DIR/pg/data/postmaster.pid" ]; then
    _as_pg "'$pgbin/pg_ctl' -D '$SERVICES_DIR/pg/data' -m fast stop >/dev/null" || true
  fi
  if [ -f "$SERVICES_DIR/redis.pid" ]; then
    kill "$(cat "$SERVICES_DIR/redis.pid")" 2>/dev/null || true
  fi
  rm -rf "$SERVICES_DIR"
}
