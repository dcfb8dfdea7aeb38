"""Benchmark ``alock`` on Redis against the sync ``lock`` and redis-py's ``redis.asyncio`` Lock.

    .venv/bin/python bench/async_locks.py [--url redis://127.0.0.1:6379/15] [--cycles 100] [--rounds 20]
        [--seconds 5] [--contended-rounds 3]

Side by side in one run, on one Redis server, in one process:
- uncontended: the latency of one acquire + release (median and p90 of every
  cycle, rounds interleaved; the ratios are medians of per-round ratios);
- contended: 100 contenders on one lock for ``--seconds``, each doing a
  read, a pause of the event loop (or a thread switch) and a write of a shared
  counter inside: cycles/s, the median and worst wait for the lock (medians
  over ``--contended-rounds`` interleaved runs), and lost updates.
The row "distlocks" is ``alock``, "aread_write_lock write" the write side of a read-write lock. The async contenders are 100 tasks on one event loop; the sync lock's are 100
threads. redis-py's asyncio Lock polls every 5 ms while it waits (``sleep``;
its default is 100 ms) and is neither reentrant, fenced nor renewed.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import arguments  # noqa: E402

os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
# The uncontended sync lock is measured in the loop's thread on purpose (one Redis round trip, no wait):
# allowed, as for Django's own sync-only calls, by the escape hatch (distlocks.SyncLockInAsyncContext).
os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"

IMPLS = ["redis.asyncio Lock", "distlocks", "distlocks sync lock", "aread_write_lock write"]
CONTENDERS = 100
POLL = 0.005  # redis.asyncio Lock's sleep between attempts


def setup(url: str) -> None:
    import django
    from django.conf import settings

    django.setup()
    settings.CACHES["bench"] = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}
    settings.DISTLOCKS = {"bench": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "bench"}}}


class Contender:
    """One implementation's acquire and release on one lock name, awaited (the sync lock's run in the loop's thread)."""

    def __init__(self, impl: str, url: str, client: Any) -> None:
        self.impl = impl
        self.url = url
        self.client = client

    def pair(self, name: str) -> tuple[Callable[[], Awaitable[object]], Callable[[], Awaitable[object]]]:
        import distlocks

        if self.impl == "redis.asyncio Lock":
            lk = self.client.lock(name, timeout=30, sleep=POLL)
            return lk.acquire, lk.release
        if self.impl == "distlocks":
            alk = distlocks.alock(name, using="bench", ttl=30, wait=None)
            return alk.acquire, alk.release
        if self.impl == "aread_write_lock write":
            side = distlocks.aread_write_lock(name, using="bench", ttl=30, wait=None).write()
            return side.acquire, side.release
        slk = distlocks.lock(name, using="bench", ttl=30, wait=None)

        async def acquire() -> object:
            return slk.acquire()

        async def release() -> object:
            slk.release()
            return None

        return acquire, release


async def uncontended(contender: Contender, cycles: int) -> list[float]:
    acquire, release = contender.pair(f"bench-async-{uuid.uuid4().hex}")
    samples = []
    for _ in range(cycles):
        started = time.perf_counter()
        await acquire()
        await release()
        samples.append(time.perf_counter() - started)
    return samples


async def contended_async(contender: Contender, seconds: float) -> dict[str, float]:
    """``CONTENDERS`` tasks on one lock: each waits, reads the counter, yields to the loop, writes it."""
    name = f"bench-async-{uuid.uuid4().hex}"
    counter = {"value": 0}
    waits: list[float] = []
    bumps = 0
    deadline = time.monotonic() + seconds

    async def one() -> None:
        nonlocal bumps
        acquire, release = contender.pair(name)
        while time.monotonic() < deadline:
            started = time.perf_counter()
            await acquire()
            waits.append(time.perf_counter() - started)
            value = counter["value"]
            await asyncio.sleep(0)  # the others run here: without the lock they would read the same value
            counter["value"] = value + 1
            bumps += 1
            await release()

    started = time.monotonic()
    await asyncio.gather(*(one() for _ in range(CONTENDERS)))
    return summary(waits, bumps, counter["value"], time.monotonic() - started)


def contended_threads(seconds: float) -> dict[str, float]:
    """``CONTENDERS`` threads on one sync lock, doing the same."""
    import distlocks

    name = f"bench-async-{uuid.uuid4().hex}"
    counter = {"value": 0}
    waits: list[float] = []
    bumps = [0]
    deadline = time.monotonic() + seconds

    def one() -> None:
        lk = distlocks.lock(name, using="bench", ttl=30, wait=None)
        while time.monotonic() < deadline:
            started = time.perf_counter()
            lk.acquire()
            waits.append(time.perf_counter() - started)
            value = counter["value"]
            time.sleep(0)  # a thread switch may happen here
            counter["value"] = value + 1
            bumps[0] += 1
            lk.release()

    threads = [threading.Thread(target=one) for _ in range(CONTENDERS)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summary(waits, bumps[0], counter["value"], time.monotonic() - started)


def summary(waits: list[float], bumps: int, counted: int, elapsed: float) -> dict[str, float]:
    waits.sort()
    return {
        "per_second": bumps / elapsed,
        "median_wait_ms": statistics.median(waits) * 1000,
        "worst_wait_ms": waits[-1] * 1000,
        "lost_updates": bumps - counted,
    }


async def measure(args: Any) -> dict[str, Any]:
    from redis.asyncio import Redis

    client = Redis.from_url(args.url)
    contenders = {impl: Contender(impl, args.url, client) for impl in IMPLS}
    for contender in contenders.values():  # connections made, scripts loaded
        await uncontended(contender, 5)
    rounds: dict[str, list[list[float]]] = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        for impl in IMPLS:
            rounds[impl].append(await uncontended(contenders[impl], args.cycles))
    runs: dict[str, list[dict[str, float]]] = {impl: [] for impl in IMPLS}
    for _ in range(args.contended_rounds):
        for impl in IMPLS:
            if impl == "distlocks sync lock":
                measured = await asyncio.to_thread(contended_threads, args.seconds)
            else:
                measured = await contended_async(contenders[impl], args.seconds)
            runs[impl].append(measured)
    await client.aclose()
    return {"rounds": rounds, "runs": runs}


def main() -> None:
    args = arguments(__doc__, 1, cycles=100, rounds=20, contended_rounds=3)
    setup(args.url)
    measured = asyncio.run(measure(args))
    rounds, runs = measured["rounds"], measured["runs"]

    def ratio(impl: str, to: str) -> float:
        """The median over rounds of this round's median against the other's in the same round."""
        return statistics.median(
            statistics.median(mine) / statistics.median(theirs)
            for mine, theirs in zip(rounds[impl], rounds[to], strict=True)
        )

    results = []
    print(
        f"Redis on {args.url}: {args.rounds}x{args.cycles} uncontended cycles; "
        f"{CONTENDERS} contenders x {args.seconds}s, median of {args.contended_rounds} runs"
    )
    header = (
        "lock",
        "median µs",
        "p90 µs",
        "x redis.asyncio",
        "contended/s",
        "median wait ms",
        "worst wait ms",
        "lost",
    )
    print("  ".join(f"{h:>22}" if i == 0 else f"{h:>15}" for i, h in enumerate(header)))
    for impl in IMPLS:
        samples = sorted(s for r in rounds[impl] for s in r)
        busy = {
            metric: sum(r[metric] for r in runs[impl])
            if metric == "lost_updates"
            else statistics.median(r[metric] for r in runs[impl])
            for metric in runs[impl][0]
        }
        row = {
            "lock": impl,
            "median_us": statistics.median(samples) * 1e6,
            "p90_us": samples[int(len(samples) * 0.9)] * 1e6,
            "x_redis_asyncio": ratio(impl, IMPLS[0]),
            **busy,
        }
        results.append(row)
        cells = [
            impl,
            f"{row['median_us']:.0f}",
            f"{row['p90_us']:.0f}",
            f"{row['x_redis_asyncio']:.2f}",
            f"{row['per_second']:.0f}",
            f"{row['median_wait_ms']:.1f}",
            f"{row['worst_wait_ms']:.1f}",
            f"{row['lost_updates']:.0f}",
        ]
        print("  ".join(f"{c:>22}" if i == 0 else f"{c:>15}" for i, c in enumerate(cells)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "async.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
