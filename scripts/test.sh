#!/usr/bin/env bash
# Install everything, start the servers that are not running, lint, type-check
# and run the whole test suite against SQLite, MariaDB and PostgreSQL: on the
# newest Python with Django 6.1, and again on Python 3.10 with Django 5.2 LTS.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
apt_ensure pkg-config libmariadb-dev mariadb-client postgresql-client redis-server zookeeper chromium docker-compose
venv_install -r requirements.txt
ensure_databases
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy distlocks demo_shop tests bench
if ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "That is Django 5.2 LTS on Python $(.venv/bin/python -c 'import platform; print(platform.python_version())') already."
  exec .venv/bin/pytest "$@"
fi
VENV=.venv-py310 PYTHON_LOWEST=3.10 PYTHON_HIGHEST=3.10 venv_install -r requirements-test.txt "Django==5.2.19"
# The two runs go side by side (most tests wait on servers, not on the CPU), each on
# servers and ports of its own; the Python 3.10 run's output follows the first's.
py310_log=$(mktemp)
trap 'rm -f "$py310_log"' EXIT
DISTLOCKS_TEST_REDIS_PORT=16700 DISTLOCKS_TEST_ZK_PORT=12600 .venv-py310/bin/pytest "$@" >"$py310_log" 2>&1 &
py310=$!
status=0
.venv/bin/pytest "$@" || status=$?
py310_status=0
wait "$py310" || py310_status=$?
echo "The same tests on Python 3.10 with Django 5.2 LTS (run alongside):"
cat "$py310_log"
exit $(( status || py310_status ))
