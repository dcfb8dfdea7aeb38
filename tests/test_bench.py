"""The benchmark scripts still run, and no lock they measure loses an update (tiny runs: no timings asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from localservers import REDIS_PORT, ZK_PORT

from .conftest import DB, ROOT

pytestmark = [DB, pytest.mark.servers("redis", "zookeeper")]

QUICK = ["--cycles", "20", "--rounds", "1", "--seconds", "0.5"]
# Two contenders race as four do, at half the processes to start (each imports Django and its driver).
CONTENDERS = ["--processes", "2"]
# Benchmark databases and ZooKeeper port of this run's own, from its test ports: runs side
# by side (scripts/test.sh's two passes) must not drop each other's databases.
ENV = {
    **os.environ,
    "DISTLOCKS_BENCH_DATABASE": f"distlocks_bench_{REDIS_PORT}",
    "DISTLOCKS_BENCH_ZK_PORT": str(ZK_PORT + 100),
}


def run(script, tmp_path, results, *arguments):
    """Run ``bench/script`` with ``arguments`` and this run's environment; the rows it wrote to ``results``."""
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--out", str(tmp_path), *arguments],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((tmp_path / results).read_text())


@pytest.mark.parametrize(
    ("script", "arguments", "results"),
    [
        (
            "redis_locks.py",
            ["--url", f"redis://127.0.0.1:{REDIS_PORT}/15", "--contended-rounds", "1", *CONTENDERS],
            "redis.json",
        ),
        ("db_locks.py", CONTENDERS, "db.json"),
        ("zookeeper_locks.py", CONTENDERS, "zookeeper.json"),
        ("async_locks.py", ["--url", f"redis://127.0.0.1:{REDIS_PORT}/15", "--contended-rounds", "1"], "async.json"),
    ],
)
def test_benchmark_runs_and_loses_no_update(script, arguments, results, tmp_path):
    rows = run(script, tmp_path, results, *QUICK, *arguments)
    assert any(row["lock"] == "distlocks" for row in rows)
    contended = [row for row in rows if "lost_updates" in row]
    assert contended, rows
    assert all(row["per_second"] > 0 for row in contended), rows
    assert [row for row in contended if row["lost_updates"]] == [], rows


def test_kinds_benchmark_runs(tmp_path):
    rows = run("kinds.py", tmp_path, "kinds.json", *QUICK[:4], "--url", f"redis://127.0.0.1:{REDIS_PORT}/15")
    assert [row["lock"] for row in rows] == [
        "lock",
        "semaphore (3 permits)",
        "multi_lock (1 name)",
        "multi_lock (2 names)",
        "read_write_lock: read",
        "read_write_lock: write",
    ]
    assert all(row["median_us"] > 0 for row in rows)


def test_db_benchmark_pins_postgresql_sessions(tmp_path):
    arguments = ["--databases", "postgresql", "--pin", "apart", "--uncontended-only"]
    rows = run("db_locks.py", tmp_path, "db.json", *QUICK[:4], *arguments)
    assert [row["lock"] for row in rows] == ["floor", "django-db-mutex", "distlocks", "native"]
    assert all(row["median_us"] > 0 and "per_second" not in row for row in rows), rows


def test_the_hot_path_profile_counts_each_backends_round_trips():
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hot_path.py"), "--cycles", "20", "--top", "3"]
        + ["--backends", "default", "redis", "--url", f"redis://127.0.0.1:{REDIS_PORT}/15"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    headings = [line for line in completed.stdout.splitlines() if line.startswith("== ")]
    # One statement each for SQLite's acquire and release; one script each for Redis's.
    assert [(line.split(":")[0], "2.0 round trips" in line) for line in headings] == [
        ("== default", True),
        ("== redis", True),
    ], completed.stdout


def test_the_cycle_cost_comparison_runs():
    completed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cycle_cost.py"), "--against", str(ROOT), "--backends", "locmem"]
        + ["--rounds", "2", "--cycles", "20"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    header, _, row = completed.stdout.splitlines()
    assert header.split(" | ") == ["backend", "this µs", "other µs", "this / other"]
    assert row.startswith("locmem | ")
