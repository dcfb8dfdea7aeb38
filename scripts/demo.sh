#!/usr/bin/env bash
# Set up a virtualenv and run the oversell demo on SQLite: no server needed.
# Extra arguments go to `manage.py oversell` (e.g. --strategies none,lock:default).
# DISTLOCKS_DB=mariadb|postgresql and the lock servers' variables (see docs/start/demo.md,
# "On MariaDB, PostgreSQL, Redis, ZooKeeper") add their drivers; the database must exist.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
extras=demo
case "${DISTLOCKS_DB:-sqlite}" in
  mariadb) apt_ensure pkg-config libmariadb-dev; extras+=",mysql" ;;  # mysqlclient builds from source
  postgresql) extras+=",postgresql" ;;
esac
[ -z "${DISTLOCKS_REDIS_URL:-}${DISTLOCKS_REDLOCK_URLS:-}" ] || extras+=",redis"
[ -z "${DISTLOCKS_ZOOKEEPER:-}" ] || extras+=",zookeeper"
venv_install -e ".[$extras]"
.venv/bin/python manage.py migrate --noinput -v 0
.venv/bin/python manage.py oversell "$@"
