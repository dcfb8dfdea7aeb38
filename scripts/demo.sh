#!/usr/bin/env bash
# Set up a virtualenv and run the oversell demo on SQLite: no server needed.
# Extra arguments go to `manage.py oversell` (e.g. --strategies none,lock:default).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
venv_install -e ".[demo]"
.venv/bin/python manage.py migrate --noinput -v 0
.venv/bin/python manage.py oversell "$@"
