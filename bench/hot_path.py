"""Where an uncontended acquire + release spends its time, backend by backend.

    .venv/bin/python bench/hot_path.py [--cycles 2000] [--top 12] [--backends default mariadb_native redis ...]
                                      [--url redis://127.0.0.1:6379/15]

For each backend (``locmem``, in this process's memory, is the core's cost
alone; ``bench/cycle_cost.py`` counts its instructions): the median time of a
cycle without the profiler, the server round trips a cycle makes, and, under
cProfile, the share of a cycle
spent in distlocks' own code, in Django, in the driver and waiting on the
socket, then the functions that take the most time themselves. Run it before
and after a change to the hot path: the round trips and the shares say where
the microseconds went; the machine's noise moves the medians, not the counts.

The database backends run on the benchmarks' databases (bench/settings.py,
created afresh), Redis on ``--url``, ZooKeeper on a server the script starts
on 127.0.0.1:12291 (``DISTLOCKS_BENCH_ZK_PORT`` plus 10).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402

import distlocks  # noqa: E402

DATABASE_BACKENDS = ["default", "mariadb", "postgresql", "mariadb_native", "postgresql_native"]
BACKENDS = ["locmem", *DATABASE_BACKENDS, "redis", "zookeeper"]
ZK_PORT = int(os.environ.get("DISTLOCKS_BENCH_ZK_PORT", "12281")) + 10
# The calls that each send one request to the server and wait for its answer: (a part of the file's path, function).
ROUND_TRIPS = [
    (f"MySQLdb{os.sep}cursors.py", "_query"),
    (f"psycopg{os.sep}_cursor_base.py", "_start_query"),
    ("~", "<function SQLiteCursorWrapper.execute"),  # Django's C-level SQLite cursor
    (f"redis{os.sep}client.py", "_execute_command"),
    (f"redis{os.sep}client.py", "_execute_transaction"),
    (f"kazoo{os.sep}", "_call"),
]
# What a file's path says it belongs to, first match wins.
LAYERS = [
    ("distlocks", f"{os.sep}distlocks{os.sep}"),
    ("Django", f"{os.sep}django{os.sep}"),
    ("driver", f"{os.sep}MySQLdb{os.sep}"),
    ("driver", f"{os.sep}psycopg{os.sep}"),
    ("driver", f"{os.sep}redis{os.sep}"),
    ("driver", f"{os.sep}django_redis{os.sep}"),
    ("driver", f"{os.sep}kazoo{os.sep}"),
    ("driver", "sqlite3"),
]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=2000, help="acquire+release cycles profiled per backend")
    parser.add_argument("--top", type=int, default=12, help="functions listed per backend")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=BACKENDS)
    parser.add_argument("--url", default="redis://127.0.0.1:6379/15", help="the Redis to profile on")
    return parser.parse_args()


def configure(url: str) -> None:
    settings.CACHES["profile"] = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}
    settings.DISTLOCKS = {
        **settings.DISTLOCKS,
        "locmem": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"},  # no server: the core's cost alone
        "redis": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "profile"}},
        "zookeeper": {
            "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
            "LOCATION": f"127.0.0.1:{ZK_PORT}",
            "OPTIONS": {"ROOT": "/distlocks-profile"},
        },
    }


def cycles_timed(lock: distlocks.DistributedLock, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        lock.acquire()
        lock.release()
        samples.append(time.perf_counter() - started)
    return samples


def is_round_trip(file: str, function: str) -> bool:
    return any(part in file and function.startswith(name) for part, name in ROUND_TRIPS)


def layer_of(filename: str) -> str:
    if filename.startswith("~") or filename.startswith("<"):
        return "socket and builtins"  # C functions: socket reads and writes, the drivers' C parts
    return next((layer for layer, part in LAYERS if part in filename), "other")


def report(using: str, count: int, top: int) -> None:
    lock = distlocks.lock(f"profile-{uuid.uuid4().hex}", using=using)
    cycles_timed(lock, 50)  # connections made, scripts loaded, tables warm
    median = statistics.median(cycles_timed(lock, count))
    profiler = cProfile.Profile()
    profiler.enable()
    cycles_timed(lock, count)
    profiler.disable()
    stats = pstats.Stats(profiler)
    entries = stats.stats  # type: ignore[attr-defined]  # {(file, line, function): (cc, calls, tottime, cumtime, callers)}
    total = sum(entry[2] for entry in entries.values())
    trips = sum(entry[1] for (file, _, function), entry in entries.items() if is_round_trip(file, function))
    layers: dict[str, float] = {}
    for (file, _, _), entry in entries.items():
        layers[layer_of(file)] = layers.get(layer_of(file), 0.0) + entry[2]
    print(f"\n== {using}: {median * 1e6:.0f} µs a cycle (median of {count}), {trips / count:.1f} round trips a cycle")
    print(
        "   under the profiler: "
        + ", ".join(f"{name} {share / total:.0%}" for name, share in sorted(layers.items(), key=lambda item: -item[1]))
    )
    ranked = sorted(entries.items(), key=lambda item: -item[1][2])[:top]
    print(f"   {'own µs/cycle':>12}  {'calls/cycle':>11}  function")
    for (file, line, function), entry in ranked:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if not file.startswith("~") else "builtin"
        print(f"   {entry[2] / count * 1e6:12.1f}  {entry[1] / count:11.1f}  {function} ({where})")


def main() -> None:
    args = arguments()
    configure(args.url)
    databases = [alias for alias in args.backends if alias in DATABASE_BACKENDS]
    if databases:
        from bench.db_locks import prepare

        prepare(
            sorted({settings.DISTLOCKS[alias].get("OPTIONS", {}).get("DATABASE", "default") for alias in databases})
        )
    server = None
    with tempfile.TemporaryDirectory() as directory:
        if "zookeeper" in args.backends:
            from localservers import ZooKeeperServer

            server = ZooKeeperServer(ZK_PORT, directory).start()
        try:
            for using in args.backends:
                report(using, args.cycles, args.top)
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
