# Sourced by scripts/test and scripts/demo: start / stop a private Redis and PostgreSQL on loopback.
# Installs them from Debian packages when missing. Exports HIGGS_TEST_REDIS_URL and
# HIGGS_TEST_POSTGRES_URL for the tests.

SERVICES_DIR=${SERVICES_DIR:-$(mktemp -d /tmp/higgs-services.XXXXXX)}
REDIS_PORT=${REDIS_PORT:-6391}
PG_PORT=${PG_PORT:-5441}

_pg_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do [ -x "$d/initdb" ] && { echo "$d"; return 0; }; done
  return 1
}

services_install() {
  local missing=()
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  _pg_bin >/dev/null 2>&1 || missing+=(postgresql)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "services: installing ${missing[*]} from Debian packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q "${missing[@]}" >/dev/null
  fi
}

services_start() {
  services_install
  chmod 755 "$SERVICES_DIR"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
    --daemonize yes --dir "$SERVICES_DIR" --logfile "$SERVICES_DIR/redis.log" \
    --pidfile "$SERVICES_DIR/redis.pid"
  local pgbin; pgbin=$(_pg_bin)
  local pguser=postgres
  id "$pguser" >/dev/null 2>&1 || useradd -r -m "$pguser"
  mkdir -p "$SERVICES_DIR/pg"; chown "$pguser" "$SERVICES_DIR/pg"
  # initdb refuses to run as root, so the cluster belongs to the postgres user.
  su "$pguser" -s /bin/sh -c "'$pgbin/initdb' -D '$SERVICES_DIR/pg/data' -U postgres --auth=trust >'$SERVICES_DIR/pg/initdb.log' 2>&1"
  su "$pguser" -s /bin/sh -c "'$pgbin/pg_ctl' -D '$SERVICES_DIR/pg/data' -w -t 300 -l '$SERVICES_DIR/pg/server.log' \
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
  echo "services: redis on 127.0.0.1:$REDIS_PORT, postgresql on 127.0.0.1:$PG_PORT ($SERVICES_DIR)"
}

services_stop() {
  local pgbin; pgbin=$(_pg_bin) || true
  if [ -f "$SERVICES_DIR/pg/data/postmaster.pid" ]; then
    su postgres -s /bin/sh -c "'$pgbin/pg_ctl' -D '$SERVICES_DIR/pg/data' -m fast stop >/dev/null" || true
  fi
  if [ -f "$SERVICES_DIR/redis.pid" ]; then
    kill "$(cat "$SERVICES_DIR/redis.pid")" 2>/dev/null || true
  fi
  rm -rf "$SERVICES_DIR"
}
