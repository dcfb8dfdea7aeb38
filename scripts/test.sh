#!/usr/bin/env bash
# Install everything, start the servers that are not running, lint, type-check
# and run the whole test suite against SQLite, MariaDB and PostgreSQL: on the
# newest Python with Django 6.1, and at the same time on Python 3.10 with
# Django 5.2 LTS. Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
apt_ensure pkg-config libmariadb-dev mariadb-client postgresql-client redis-server zookeeper chromium docker-compose pgbouncer galera-4
venv_install -r requirements.txt
# On the newest Python (Django 6.1) the tests also run on Python 3.10 with Django 5.2 LTS.
lowest=false
if .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  lowest=true
  VENV=.venv-py310 PYTHON_LOWEST=3.10 PYTHON_HIGHEST=3.10 venv_install -r requirements-test.txt "Django==5.2.19"
fi
ensure_databases
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy distlocks demo_shop tests bench
if ! $lowest; then
  .venv/bin/pytest "$@"
  echo "That was Django 5.2 LTS on Python $(.venv/bin/python -c 'import platform; print(platform.python_version())') already."
  exit 0
fi
# The two passes run side by side (the suite mostly waits: on leases, timeouts,
# servers), the second on servers of its own, on ports past the first's.
lowest_log=$(mktemp)
DISTLOCKS_TEST_REDIS_PORT=$((${DISTLOCKS_TEST_REDIS_PORT:-16379} + 200)) \
  DISTLOCKS_TEST_ZK_PORT=$((${DISTLOCKS_TEST_ZK_PORT:-12181} + 400)) \
  .venv-py310/bin/pytest "$@" >"$lowest_log" 2>&1 &
lowest_pid=$!
trap 'kill "$lowest_pid" 2>/dev/null; exit 130' INT TERM
status=0
.venv/bin/pytest "$@" || status=$?
echo "The same tests on Python 3.10 with Django 5.2 LTS, run alongside:"
wait "$lowest_pid" || status=$?
cat "$lowest_log"
rm -f "$lowest_log"
exit "$status"
