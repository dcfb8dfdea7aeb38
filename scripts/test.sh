#!/usr/bin/env bash
# Install everything, start the servers that are not running, lint, type-check,
# build the docs site (mkdocs build --strict) and run the whole test suite
# against SQLite, MariaDB and PostgreSQL: on the newest Python with Django
# 6.1, and again on Python 3.10 with Django 5.2 LTS.
# Each pass spreads the tests over TEST_WORKERS pytest-xdist workers (default 4;
# 0 runs them in one process), each with servers and databases of its own.
# Extra arguments go to pytest. Every step's time is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
workers="${TEST_WORKERS:-4}"
parallel=()
[ "$workers" -gt 0 ] && parallel=(-n "$workers")
logs=$(mktemp -d)
second_venv_job=""
# The passes' pytest summaries come last.
trap '[ -n "$second_venv_job" ] && kill "$second_venv_job" 2>/dev/null; print_times; tail -q -n 1 "$logs"/[0-9].log 2>/dev/null' EXIT

timed apt_ensure pkg-config libmariadb-dev mariadb-client postgresql postgresql-client redis-server zookeeper chromium docker-compose pgbouncer galera-4
# The second pass's virtualenv is made meanwhile (Python 3.10, Django 5.2 LTS): pip waits on the network and the disk.
second_venv() {
  export VENV=.venv-py310 PYTHON_LOWEST=3.10 PYTHON_HIGHEST=3.10
  venv_install -r requirements-test.txt "Django==5.2.19" && venv_install --no-deps -r requirements-beat.txt
}
second_venv >"$logs/venv-py310.log" 2>&1 &
second_venv_job=$!
timed venv_install -r requirements.txt
timed venv_install --no-deps -r requirements-beat.txt
timed ensure_databases
timed .venv/bin/ruff check .
timed .venv/bin/ruff format --check .
timed .venv/bin/mypy distlocks demo_shop tests bench localservers.py
timed build_docs
python_version() { "$1/bin/python" -c 'import platform; print(platform.python_version())'; }
echo "The tests on Python $(python_version .venv) with Django $(.venv/bin/python -m django --version):"
timed pass_log "$logs/1.log" .venv/bin/pytest "${parallel[@]}" "$@"
if ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "That was Django 5.2 LTS on Python $(python_version .venv) already."
  exit 0
fi
if ! timed wait "$second_venv_job"; then
  cat "$logs/venv-py310.log" >&2
  exit 1
fi
second_venv_job=""
echo "The same tests on Python $(python_version .venv-py310) with Django 5.2 LTS:"
timed pass_log "$logs/2.log" .venv-py310/bin/pytest "${parallel[@]}" "$@"
