"""Benchmark the read-write lock against the plain lock (a mutex), and against kazoo's ReadLock/WriteLock.

    DISTLOCKS_TEST_REDIS_PORT=... DISTLOCKS_TEST_ZK_PORT=... .venv/bin/python bench/rw_locks.py [--seconds 5] [--rounds 3]

Side by side in one run, on a Redis and a standalone ZooKeeper that the
script starts on the tests' ports (and stops afterwards): 8 reader processes
and 1 writer process share one lock for ``--seconds``, timed after a common
start (see ``common.start_together``). A reader holds its lock 5 ms per read
(sleeping: the work of a read) and reads again at once; the writer holds the
write lock 5 ms and writes every 50 ms. With the mutex every read excludes
every other; with a read-write lock the readers read together. Reported: reads
and writes per second (medians over rounds, the implementations interleaved
in each round), and the read throughput against the mutex's on the same server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import arguments, start_together  # noqa: E402

os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"

# implementation -> (DISTLOCKS alias, kind)
IMPLS = {
    "Redis: mutex": ("bench_redis", "mutex"),
    "Redis: read_write_lock": ("bench_redis", "rw"),
    "ZooKeeper: mutex": ("bench_zk", "mutex"),
    "ZooKeeper: read_write_lock": ("bench_zk", "rw"),
    "ZooKeeper: kazoo ReadLock/WriteLock": ("bench_zk", "kazoo"),
}
READERS = 8
READ_HOLD = 0.005
WRITE_HOLD = 0.005
WRITE_EVERY = 0.05


def setup() -> None:
    import django
    from django.conf import settings

    from localservers import REDIS_PORT, ZK_PORT, redis_url

    django.setup()
    settings.CACHES["bench"] = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_url(REDIS_PORT)}
    settings.DISTLOCKS = {
        "bench_redis": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "bench"}},
        "bench_zk": {
            "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
            "LOCATION": f"127.0.0.1:{ZK_PORT}",
            "OPTIONS": {"ROOT": "/distlocks-bench"},
        },
    }


def sides(
    impl: str, name: str
) -> tuple[Callable[[], object], Callable[[], object], Callable[[], object], Callable[[], object]]:
    """(read acquire, read release, write acquire, write release) of ``impl`` on the lock ``name``."""
    import distlocks

    alias, kind = IMPLS[impl]
    if kind == "mutex":
        mutex = distlocks.lock(name, using=alias, ttl=30, wait=None)
        return mutex.acquire, mutex.release, mutex.acquire, mutex.release
    if kind == "rw":
        rw = distlocks.read_write_lock(name, using=alias, ttl=30, wait=None)
        return rw.read().acquire, rw.read().release, rw.write().acquire, rw.write().release
    from kazoo.client import KazooClient

    from localservers import ZK_PORT

    zk = KazooClient(hosts=f"127.0.0.1:{ZK_PORT}")
    zk.start()
    reading, writing = zk.ReadLock(f"/kazoo-bench/{name}"), zk.WriteLock(f"/kazoo-bench/{name}")
    return reading.acquire, reading.release, writing.acquire, writing.release


def worker(impl: str, role: str, name: str, seconds: float, counter: str) -> None:
    """Read (or write) in a loop for ``seconds`` after the common start; print how many times."""
    read, unread, write, unwrite = sides(impl, name)
    take, give, hold = (read, unread, READ_HOLD) if role == "reader" else (write, unwrite, WRITE_HOLD)
    take()  # warm up: connections made, scripts loaded
    give()
    start_together(Path(counter), READERS + 1)
    done = 0
    worst = 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        take()
        worst = max(worst, time.monotonic() - started)
        time.sleep(hold)
        give()
        done += 1
        if role == "writer":
            time.sleep(max(0.0, WRITE_EVERY - (time.monotonic() - started)))
    print(json.dumps({"role": role, "done": done, "worst": worst}))


def run_once(impl: str, seconds: float, tmp: Path) -> dict[str, float]:
    """One contended run of ``impl``: reads and writes per second, the worst wait of each (seconds)."""
    name = f"bench-{uuid.uuid4().hex}"
    counter = tmp / f"start-{uuid.uuid4().hex}"
    roles = ["reader"] * READERS + ["writer"]
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", impl, role, name, str(seconds), str(counter)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for role in roles
    ]
    reports = [json.loads(p.communicate(timeout=seconds * 10 + 60)[0].splitlines()[-1]) for p in processes]
    reads = sum(r["done"] for r in reports if r["role"] == "reader")
    writes = sum(r["done"] for r in reports if r["role"] == "writer")
    return {
        "reads_per_second": reads / seconds,
        "writes_per_second": writes / seconds,
        "worst_read": max(r["worst"] for r in reports if r["role"] == "reader"),
        "worst_write": max(r["worst"] for r in reports if r["role"] == "writer"),
    }


def main() -> None:
    args = arguments(__doc__, 5, rounds=3)
    setup()
    if args.worker:
        impl, role, name, seconds, counter = args.worker
        worker(impl, role, name, float(seconds), counter)
        return

    from localservers import REDIS_PORT, ZK_PORT, RedisServer, ZooKeeperServer

    with tempfile.TemporaryDirectory() as directory:
        redis = RedisServer(REDIS_PORT).start()
        zookeeper = ZooKeeperServer(ZK_PORT, directory).start()
        try:
            run(args, Path(directory))
        finally:
            zookeeper.stop()
            redis.stop()


def run(args: argparse.Namespace, tmp: Path) -> None:
    measured: dict[str, list[dict[str, float]]] = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        for impl in IMPLS:
            measured[impl].append(run_once(impl, args.seconds, tmp))
    print(
        f"{READERS} readers ({READ_HOLD * 1000:.0f} ms a read) and 1 writer ({WRITE_HOLD * 1000:.0f} ms every "
        f"{WRITE_EVERY * 1000:.0f} ms), {args.rounds} rounds x {args.seconds}s; medians over rounds"
    )
    print(f" {'lock':<38}{'reads/s':>9}{'writes/s':>10}{'x mutex':>9}{'worst read ms':>15}{'worst write ms':>16}")
    results: list[dict[str, Any]] = []
    for impl in IMPLS:
        mutex = IMPLS[impl][0] == "bench_redis" and "Redis: mutex" or "ZooKeeper: mutex"
        reads = statistics.median(r["reads_per_second"] for r in measured[impl])
        writes = statistics.median(r["writes_per_second"] for r in measured[impl])
        ratio = statistics.median(
            mine["reads_per_second"] / theirs["reads_per_second"]
            for mine, theirs in zip(measured[impl], measured[mutex], strict=True)
        )
        worst_read = statistics.median(r["worst_read"] for r in measured[impl]) * 1000
        worst_write = statistics.median(r["worst_write"] for r in measured[impl]) * 1000
        results.append(
            {
                "lock": impl,
                "reads_per_second": reads,
                "writes_per_second": writes,
                "x_mutex": ratio,
                "worst_read_ms": worst_read,
                "worst_write_ms": worst_write,
            }
        )
        print(f" {impl:<38}{reads:>9.0f}{writes:>10.1f}{ratio:>9.2f}{worst_read:>15.0f}{worst_write:>16.0f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rw_locks.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
