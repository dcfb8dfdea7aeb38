"""Benchmark the ZooKeeper backend against kazoo's Lock recipe and the floor.

    .venv/bin/python bench/zookeeper_locks.py [--cycles 300] [--rounds 5] [--seconds 5] [--processes 4]

Side by side in one run, on a standalone ZooKeeper that the script starts on
127.0.0.1:12281 (and stops afterwards):
- uncontended: the latency of one acquire + release (median and p90 of every
  cycle, rounds interleaved);
- contended: ``--processes`` (4) processes on one lock, timed for ``--seconds`` after a warm-up
  (see ``common.contend``), each doing a read-modify-write of a shared
  counter file inside: total cycles/s, the
  median and worst wait, lost updates, and whether the lock went round in
  FIFO order (the share of hand-overs that went to the process that had
  waited longest).
The floor is a bare create + delete of an ephemeral sequential node: 2 requests,
no waiting, no ordering.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench.common import arguments, contend_blocking, contender_command, run_contenders, time_cycles  # noqa: E402

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

IMPLS = ["floor", "kazoo Lock", "distlocks"]
PORT = int(os.environ.get("DISTLOCKS_BENCH_ZK_PORT", "12281"))  # another lets two runs go at once


def setup() -> None:
    import django
    from django.conf import settings

    django.setup()
    settings.DISTLOCKS = {
        "bench": {
            "BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend",
            "LOCATION": f"127.0.0.1:{PORT}",
            "OPTIONS": {"ROOT": "/distlocks-bench"},
        }
    }


_client: Any = None


def client() -> Any:
    global _client
    if _client is None:
        from kazoo.client import KazooClient

        _client = KazooClient(hosts=f"127.0.0.1:{PORT}")
        _client.start()
    return _client


def cycle_of(impl: str, name: str) -> tuple[Callable[[], object], Callable[[], object]]:
    """Return blocking (acquire, release) for ``impl`` on the lock ``name``."""
    import distlocks

    if impl == "floor":
        zk = client()
        zk.ensure_path(f"/floor/{name}")
        node: list[str] = []

        def floor_acquire() -> None:
            node.append(zk.create(f"/floor/{name}/lock-", ephemeral=True, sequence=True))

        return floor_acquire, lambda: zk.delete(node.pop())
    if impl == "kazoo Lock":
        lock = client().Lock(f"/kazoo/{name}")
        return lock.acquire, lock.release
    dlock = distlocks.lock(name, using="bench", ttl=30)
    return dlock.acquire, dlock.release


def uncontended(impl: str, cycles: int) -> list[float]:
    return time_cycles(*cycle_of(impl, f"bench-{uuid.uuid4().hex}"), cycles)


def worker(impl: str, name: str, seconds: float, counter: str, log: str, processes: int) -> None:
    """One contending process: print its waits as JSON; log when it asked and when it got the lock."""
    with open(log, "a") as events:

        def note(event: str) -> None:
            events.write(f"{event} {os.getpid()}\n")
            events.flush()

        waits, bumps = contend_blocking(*cycle_of(impl, name), Path(counter), processes, seconds, note)
    print(json.dumps({"waits": waits, "bumps": bumps}))


def fifo_share(log: Path) -> float:
    """The share of grants that went to the process that had asked first among those waiting."""
    waiting: list[str] = []
    fair = total = 0
    for line in log.read_text().splitlines():
        event, pid = line.split()
        if event == "ask":
            waiting.append(pid)
        elif pid in waiting:
            total += 1
            fair += waiting[0] == pid
            waiting.remove(pid)
    return fair / total if total else 1.0


def contended(impl: str, seconds: float, processes: int, tmp: Path) -> dict[str, float]:
    counter = tmp / f"counter-{uuid.uuid4().hex}"
    counter.write_text("0")
    log = tmp / f"log-{uuid.uuid4().hex}"
    name = f"bench-{uuid.uuid4().hex}"
    command = contender_command(__file__, processes, [impl, name, seconds, counter, log])
    _, figures = run_contenders(command, counter, processes, seconds)
    return {**figures, "fifo": fifo_share(log)}


def main() -> None:
    args = arguments(__doc__, 5, processes=4)
    setup()
    if args.worker:
        impl, name, seconds, counter, log = args.worker
        worker(impl, name, float(seconds), counter, log, args.processes)
        return

    from localservers import ZooKeeperServer

    with tempfile.TemporaryDirectory() as directory:
        server = ZooKeeperServer(PORT, directory).start()
        try:
            run(args, Path(directory))
        finally:
            server.stop()


def run(args: argparse.Namespace, tmp: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    samples: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        for impl in IMPLS:
            samples[impl] += uncontended(impl, args.cycles)
    # The floor takes no turns: it has no contended run.
    busy = {impl: contended(impl, args.seconds, args.processes, tmp) for impl in IMPLS if impl != "floor"}
    floor = statistics.median(samples["floor"])
    kazoo = statistics.median(samples["kazoo Lock"])
    table = Table(
        title=f"ZooKeeper locks: {args.rounds}x{args.cycles} uncontended cycles, {args.processes} processes x {args.seconds}s contended"
    )
    columns = ["lock", "median µs", "p90 µs", "x floor", "x kazoo", "contended/s", "median wait ms", "worst wait ms"]
    for column in [*columns, "FIFO", "lost updates"]:
        table.add_column(column, justify="left" if column == "lock" else "right")
    results = []
    for impl in IMPLS:
        values = sorted(samples[impl])
        median = statistics.median(values)
        measured = busy.get(impl)
        results.append({"lock": impl, "median_us": median * 1e6, **(measured or {})})
        busy_cells = ["-"] * 5
        if measured:
            busy_cells = [
                f"{measured['per_second']:.0f}",
                f"{measured['median_wait_ms']:.2f}",
                f"{measured['worst_wait_ms']:.1f}",
                f"{measured['fifo']:.0%}",
                str(measured["lost_updates"]),
            ]
        table.add_row(
            impl,
            f"{median * 1e6:.0f}",
            f"{values[int(len(values) * 0.9)] * 1e6:.0f}",
            f"{median / floor:.2f}",
            f"{median / kazoo:.2f}",
            *busy_cells,
        )
    Console(width=160).print(table)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "zookeeper.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
