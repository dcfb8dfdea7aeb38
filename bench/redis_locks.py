"""Benchmark the Redis backend against redis-py's Lock, python-redis-lock, pottery and the floor.

    .venv/bin/python bench/redis_locks.py [--url redis://127.0.0.1:6379/15] [--cycles 100] [--rounds 50]
        [--seconds 5] [--contended-rounds 3] [--processes 4]

Side by side in one run, on one Redis server:
- uncontended: the latency of one acquire + release (median and p90 of every
  cycle, rounds interleaved so that noise hits every contender alike; the
  ratios are medians of per-round ratios);
- contended: ``--processes`` (4) processes on one lock, timed for ``--seconds`` after a warm-up
  (see ``common.contend``), each doing a read-modify-write of a shared
  counter file inside: total cycles/s, the median,
  p99 and worst wait for the lock (each the median over ``--contended-rounds``
  interleaved runs), and the lost updates of all runs.
The floor is a bare ``SET NX PX`` plus an ``EVALSHA`` compare-and-delete: not
reentrant, not fenced, not renewed. Its contended run polls every millisecond.
"distlocks scripts" runs distlocks' acquire and release scripts alone, polling
as the floor does: between it and the floor is what the scripts cost (the
server's work and their arguments); between it and "distlocks", the Python
around them.
The "x5" rows run Redlock over five Redis servers that the script starts on
loopback ports 16390-16394 and stops afterwards. With ``--cluster``, the
"cluster" rows run redis-py's Lock and distlocks on a Redis Cluster that the
script starts (3 primaries, a replica each) on ports 16600-16605 (cluster bus
16610-16615): each lock on the primary of its slot, through
``RedisCluster``. With ``--sentinel``, the "sentinel" rows run them on the
master of a Sentinel group that the script starts (a master and two replicas
on ports 16620-16622, three sentinels on 16623-16625), through redis-py's
``Sentinel(...).master_for()``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench.common import arguments, contend_blocking, contender_command, run_contenders, time_cycles  # noqa: E402

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

IMPLS = [
    "floor",
    "redis-py Lock",
    "python-redis-lock",
    "pottery Redlock",
    "distlocks scripts",
    "distlocks",
    "pottery Redlock x5",
    "distlocks Redlock x5",
]
NODE_PORTS = [16390 + i for i in range(5)]  # the bench's own Redlock nodes
CLUSTER_PORTS = [16600 + i for i in range(6)]  # the bench's own Redis Cluster, and its cluster bus
CLUSTER_BUS_PORTS = [16610 + i for i in range(6)]
CLUSTER_IMPLS = ["redis-py Lock cluster", "distlocks cluster"]
SENTINEL_DATA_PORTS = [16620 + i for i in range(3)]  # the bench's own Sentinel group: master, replicas, sentinels
SENTINEL_PORTS = [16623 + i for i in range(3)]
SENTINEL_IMPLS = ["redis-py Lock sentinel", "distlocks sentinel"]
COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def setup(url: str) -> None:
    import django
    from django.conf import settings

    from localservers import SENTINEL_SERVICE

    django.setup()
    settings.CACHES["bench"] = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}
    for i, port in enumerate(NODE_PORTS):
        settings.CACHES[f"node{i}"] = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{port}/0",
        }
    settings.DISTLOCKS = {
        "bench": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "bench"}},
        "bench-cluster": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "OPTIONS": {"CLUSTER": [f"127.0.0.1:{port}" for port in CLUSTER_PORTS[:3]]},
        },
        "bench-sentinel": {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "OPTIONS": {"SENTINELS": [f"127.0.0.1:{port}" for port in SENTINEL_PORTS], "SERVICE": SENTINEL_SERVICE},
        },
        "bench-redlock": {
            "BACKEND": "distlocks.backends.redlock.RedlockBackend",
            "OPTIONS": {"CACHES": [f"node{i}" for i in range(len(NODE_PORTS))]},
        },
    }


def cycle_of(impl: str, name: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """Return blocking (acquire, release) for ``impl`` on the lock ``name``."""
    from django_redis import get_redis_connection

    import distlocks

    client = get_redis_connection("bench")
    if impl == "floor":
        cad = client.register_script(COMPARE_AND_DELETE)
        token = secrets.token_hex(16)

        def floor_acquire() -> None:
            while not client.set(name, token, nx=True, px=30000):
                time.sleep(0.001)

        return floor_acquire, lambda: cad(keys=[name], args=[token])
    if impl == "redis-py Lock":
        lock = client.lock(name, timeout=30)
        return lock.acquire, lock.release
    if impl == "redis-py Lock cluster":
        from redis.cluster import ClusterNode, RedisCluster

        cluster = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port) for port in CLUSTER_PORTS[:3]])
        lock = cluster.lock(name, timeout=30)
        return lock.acquire, lock.release
    if impl == "redis-py Lock sentinel":
        from redis.sentinel import Sentinel

        from localservers import SENTINEL_SERVICE

        master = Sentinel([("127.0.0.1", port) for port in SENTINEL_PORTS]).master_for(SENTINEL_SERVICE)
        lock = master.lock(name, timeout=30)
        return lock.acquire, lock.release
    if impl == "python-redis-lock":
        import redis_lock

        plock = redis_lock.Lock(client, name, expire=30)
        return plock.acquire, plock.release
    if impl == "distlocks scripts":
        # distlocks' own acquire and release scripts alone, through redis-py, polling as the floor does: what the
        # server and the scripts' arguments cost. The rest of distlocks' figure is the Python around them.
        from distlocks.backends.redis.keys import acquire_keys
        from distlocks.backends.redis.scripts import ACQUIRE, RELEASE
        from distlocks.backends.redis.strays import attempt_id

        take, give_back = client.register_script(ACQUIRE), client.register_script(RELEASE)
        keys, secret = acquire_keys(name), secrets.token_hex(16)

        def scripts_acquire() -> None:
            # Each attempt's id unique across processes: the script answers a known id with the hold it took.
            while take(keys=keys, args=[attempt_id(), secret, 30000, "0 bench"]) < 0:
                time.sleep(0.001)

        return scripts_acquire, lambda: give_back(keys=keys[:3], args=[secret])
    if impl.startswith("pottery Redlock"):
        from pottery import Redlock

        masters = {get_redis_connection(f"node{i}") for i in range(len(NODE_PORTS))} if "x5" in impl else {client}
        redlock = Redlock(key=name, masters=masters, auto_release_time=30)
        return redlock.acquire, redlock.release
    alias = (
        "bench-redlock"
        if "x5" in impl
        else next((f"bench-{topology}" for topology in ("cluster", "sentinel") if impl.endswith(topology)), "bench")
    )
    dlock = distlocks.lock(name, using=alias, ttl=30)
    return dlock.acquire, dlock.release


def uncontended(impl: str, cycles: int) -> list[float]:
    return time_cycles(*cycle_of(impl, f"bench-{uuid.uuid4().hex}"), cycles)


def worker(impl: str, name: str, seconds: float, counter: str, processes: int) -> None:
    """One of the contending processes: print its cycles and waits as JSON."""
    waits, bumps = contend_blocking(*cycle_of(impl, name), Path(counter), processes, seconds)
    print(json.dumps({"waits": waits, "bumps": bumps}))


def contended(impl: str, url: str, seconds: float, processes: int, tmp: Path) -> dict[str, float]:
    counter = tmp / f"counter-{uuid.uuid4().hex}"
    counter.write_text("0")
    name = f"bench-{uuid.uuid4().hex}"
    command = contender_command(__file__, processes, [impl, name, seconds, counter], ("--url", url))
    return run_contenders(command, counter, processes, seconds)[1]


def main() -> None:
    # Short rounds (about 30 ms each) spread this shared machine's bursts of noise over every contender.
    args = arguments(__doc__, 4, cycles=100, rounds=50, contended_rounds=3, processes=4, cluster=True)
    setup(args.url)
    if args.worker:
        impl, name, seconds, counter = args.worker
        worker(impl, name, float(seconds), counter, args.processes)
        return

    from rich.console import Console
    from rich.table import Table

    from localservers import ClusterServers, RedisServer, SentinelServers

    nodes = [RedisServer(port).start() for port in NODE_PORTS]
    directory = tempfile.TemporaryDirectory()
    cluster = ClusterServers(CLUSTER_PORTS, CLUSTER_BUS_PORTS, directory.name).start() if args.cluster else None
    group = None
    try:
        if args.sentinel:
            group = SentinelServers(SENTINEL_DATA_PORTS, SENTINEL_PORTS, directory.name).start()
        impls = [*IMPLS, *(CLUSTER_IMPLS if cluster else []), *(SENTINEL_IMPLS if group else [])]
        run(args, impls, Console, Table)
    finally:
        for node in nodes:
            node.stop()
        for servers in (cluster, group):
            if servers is not None:
                servers.stop()
        directory.cleanup()


def run(args: argparse.Namespace, impls: list[str], Console: Any, Table: Any) -> None:  # noqa: N803
    rounds: dict[str, list[list[float]]] = {impl: [] for impl in impls}
    for _ in range(args.rounds):
        for impl in impls:
            rounds[impl].append(uncontended(impl, args.cycles))
    samples = {impl: [s for r in measured for s in r] for impl, measured in rounds.items()}
    tmp = args.out
    tmp.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {impl: [] for impl in impls}
    for _ in range(args.contended_rounds):
        for impl in impls:
            runs[impl].append(contended(impl, args.url, args.seconds, args.processes, tmp))
    busy = {
        impl: {
            metric: sum(r[metric] for r in measured)
            if metric == "lost_updates"
            else statistics.median(r[metric] for r in measured)
            for metric in measured[0]
        }
        for impl, measured in runs.items()
    }

    def ratio(impl: str, to: str) -> float:
        """The median over rounds of this round's median against the other's in the same round.

        Paired by round, so that the machine slowing down or speeding up
        between rounds does not show as a difference between locks.
        """
        return statistics.median(
            statistics.median(mine) / statistics.median(theirs)
            for mine, theirs in zip(rounds[impl], rounds[to], strict=True)
        )

    table = Table(
        title=f"Redis locks on {args.url}: {args.rounds}x{args.cycles} uncontended cycles, "
        f"{args.processes} processes x {args.seconds}s contended, median of {args.contended_rounds} runs"
    )
    columns = [
        "lock",
        "median µs",
        "p90 µs",
        "x floor",
        "x distlocks",
        "contended/s",
        "median wait ms",
        "p99 wait ms",
        "worst wait ms",
        "lost updates",
    ]
    for column in columns:
        table.add_column(column, justify="left" if column == "lock" else "right")
    results = []
    for impl in impls:
        values = sorted(samples[impl])
        median = statistics.median(values)
        measured = busy[impl]
        results.append({"lock": impl, "median_us": median * 1e6, "x_floor": ratio(impl, "floor"), **measured})
        table.add_row(
            impl,
            f"{median * 1e6:.0f}",
            f"{values[int(len(values) * 0.9)] * 1e6:.0f}",
            f"{ratio(impl, 'floor'):.2f}",
            f"{ratio(impl, 'distlocks'):.2f}",
            f"{measured['per_second']:.0f}",
            f"{measured['median_wait_ms']:.2f}",
            f"{measured['p99_wait_ms']:.1f}",
            f"{measured['worst_wait_ms']:.1f}",
            str(measured["lost_updates"]),
        )
    Console(width=160).print(table)
    (tmp / "redis.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
