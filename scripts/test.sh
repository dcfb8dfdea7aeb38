#!/usr/bin/env bash
# Install everything, start the servers that are not running, lint, type-check
# and run the whole test suite against SQLite, MariaDB and PostgreSQL, on
# Django 6.1 and again on Django 5.2 LTS. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
apt_ensure pkg-config libmariadb-dev mariadb-client postgresql-client redis-server zookeeper chromium docker-compose
venv_install -r requirements.txt
ensure_databases
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy distlocks demo_shop
.venv/bin/pytest "$@"
echo "The same tests on Django 5.2 LTS:"
VENV=.venv-django52 venv_install -r requirements-test.txt "Django==5.2.19"
.venv-django52/bin/pytest "$@"
