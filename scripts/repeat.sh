#!/usr/bin/env bash
# Run chosen tests N times in a row, to tell a flaky test from a broken one:
#   bash scripts/repeat.sh tests/test_redlock.py 20
#   bash scripts/repeat.sh "tests/test_celery.py::test_dedupe_at_enqueue_returns_the_queued_tasks_result" 10 -n 2
# The first argument is what pytest selects (quote it if it has spaces), the
# second how many runs (default 10); the rest go to pytest. Set VENV=.venv-py310
# for the Python 3.10 pass. Every run goes on; the summary counts the failures
# and names the tests that failed, with how often; the exit status is 1 if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
selection="${1:?usage: bash scripts/repeat.sh TESTS [RUNS] [PYTEST ARGS...]}"
runs="${2:-10}"
shift $(($# < 2 ? $# : 2))
venv="${VENV:-.venv}"
logs=$(mktemp -d)
failed_runs=0
for run in $(seq 1 "$runs"); do
  started=$SECONDS
  if "$venv/bin/pytest" -p no:cacheprovider -q -rf "$selection" "$@" >"$logs/$run.log" 2>&1; then
    verdict=passed
  else
    verdict=FAILED
    failed_runs=$((failed_runs + 1))
  fi
  echo "run $run/$runs: $verdict in $((SECONDS - started)) s ($(tail -n 1 "$logs/$run.log"))"
done
echo "$failed_runs of $runs runs failed; logs in $logs"
grep -h '^FAILED\|^ERROR' "$logs"/*.log | sed 's/ - .*//' | sort | uniq -c | sort -rn
[ "$failed_runs" -eq 0 ]
