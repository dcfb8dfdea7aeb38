"""Benchmark the other kinds of lock against the plain lock on Redis: uncontended acquire + release.

    .venv/bin/python bench/kinds.py [--url redis://127.0.0.1:6379/15] [--cycles 100] [--rounds 50]

Each kind is timed on names of its own, rounds interleaved so that noise hits
every kind alike; "x lock" is the median over rounds of the kind's median
against the plain lock's in the same round. The semaphore looks at its permits
marker once a ``ttl`` per process, so a steady loop pays that about never.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import arguments, time_cycles  # noqa: E402

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

# kind -> how many names a multi-lock takes (0: not a multi-lock)
KINDS = {
    "lock": 0,
    "semaphore (3 permits)": 0,
    "multi_lock (1 name)": 1,
    "multi_lock (2 names)": 2,
    "read_write_lock: read": 0,
    "read_write_lock: write": 0,
}


def setup(url: str) -> None:
    import django
    from django.conf import settings

    django.setup()
    settings.CACHES["bench"] = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}
    settings.DISTLOCKS = {"bench": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "bench"}}}


def cycle_of(kind: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """Return (acquire, release) of a fresh lock of ``kind``, warmed up by one cycle."""
    import distlocks

    name = f"bench-{uuid.uuid4().hex}"
    lock: distlocks.DistributedLock | distlocks.Semaphore | distlocks.MultiLock
    if kind == "lock":
        lock = distlocks.lock(name, using="bench", ttl=30)
    elif kind.startswith("read_write_lock"):
        rw = distlocks.read_write_lock(name, using="bench", ttl=30)
        lock = rw.read() if kind.endswith("read") else rw.write()
    elif kind.startswith("semaphore"):
        lock = distlocks.semaphore(name, 3, using="bench", ttl=30)
    else:
        lock = distlocks.multi_lock([f"{name}-{i}" for i in range(KINDS[kind])], using="bench", ttl=30)
    lock.acquire()
    lock.release()
    return lock.acquire, lock.release


def main() -> None:
    args = arguments(__doc__, 1, cycles=100, rounds=50)
    setup(args.url)
    rounds: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            rounds[kind].append(time_cycles(*cycle_of(kind), args.cycles))
    results = []
    print(f"Kinds of lock on {args.url}: {args.rounds}x{args.cycles} uncontended acquire + release cycles")
    print(f" {'kind':<24}{'median µs':>11}{'p90 µs':>9}{'x lock':>9}")
    for kind in KINDS:
        values = sorted(s for r in rounds[kind] for s in r)
        ratio = statistics.median(
            statistics.median(mine) / statistics.median(theirs)
            for mine, theirs in zip(rounds[kind], rounds["lock"], strict=True)
        )
        median, p90 = statistics.median(values) * 1e6, values[int(len(values) * 0.9)] * 1e6
        results.append({"lock": kind, "median_us": median, "p90_us": p90, "x_lock": ratio})
        print(f" {kind:<24}{median:>11.0f}{p90:>9.0f}{ratio:>9.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kinds.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
