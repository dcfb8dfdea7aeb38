#!/usr/bin/env bash
# Install everything, start the servers that are not running, lint, type-check
# and run the whole test suite against SQLite, MariaDB and PostgreSQL: on the
# newest Python with Django 6.1, and again on Python 3.10 with Django 5.2 LTS.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
apt_ensure pkg-config libmariadb-dev mariadb-client postgresql postgresql-client redis-server zookeeper chromium docker-compose pgbouncer galera-4
venv_install -r requirements.txt
ensure_databases
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy distlocks demo_shop tests bench localservers.py
.venv/bin/pytest "$@"
if ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "That was Django 5.2 LTS on Python $(.venv/bin/python -c 'import platform; print(platform.python_version())') already."
  exit 0
fi
echo "The same tests on Python 3.10 with Django 5.2 LTS:"
VENV=.venv-py310 PYTHON_LOWEST=3.10 PYTHON_HIGHEST=3.10 venv_install -r requirements-test.txt "Django==5.2.19"
.venv-py310/bin/pytest "$@"
