"""The cost of one uncontended acquire + release, this checkout against another, side by side in one run.

    .venv/bin/python bench/cycle_cost.py --against ../base [--backends locmem default redis]
                                        [--rounds 15] [--cycles 1000] [--instructions 2000]
                                        [--url redis://127.0.0.1:6379/15] [--zk-port 12301]

``--against`` is another checkout of distlocks (``git worktree add ../base main``).
Each backend runs in one process per checkout, kept for the whole run; the
rounds alternate between the two (which goes first too), each timing
``--cycles`` cycles, so that both see the same load: the table gives the
median of the rounds' median cycle and the median of the per-round ratios.
With ``--instructions N`` it also counts, under valgrind's callgrind, the
instructions a cycle executes: a run that makes N cycles less one that makes
none, over N. Counts barely move with the machine's load, where times do:
read them to compare changes to the core (``locmem``, the in-process backend,
is the core's cost alone: it has no server).

The database backends run on the benchmarks' databases (bench/settings.py,
created afresh, a name of their own per checkout), Redis on ``--url``,
ZooKeeper on a server the script starts on 127.0.0.1:``--zk-port``
(``DISTLOCKS_BENCH_ZK_PORT`` plus 20 by default) and stops afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["locmem", "default", "mariadb", "postgresql", "mariadb_native", "postgresql_native", "redis", "zookeeper"]
DATABASES = {"default": "default", "mariadb": "mariadb", "postgresql": "postgresql"}
DATABASES.update({"mariadb_native": "mariadb", "postgresql_native": "postgresql"})
WARM_CYCLES = 50


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, help="the other checkout of distlocks to compare with")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=["locmem", "default", "redis"])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per backend and checkout")
    parser.add_argument("--cycles", type=int, default=1000, help="acquire+release cycles timed per round")
    parser.add_argument("--instructions", type=int, default=0, help="cycles counted under callgrind (0: none)")
    parser.add_argument("--url", default="redis://127.0.0.1:6379/15", help="the Redis to run on")
    zk_port = int(os.environ.get("DISTLOCKS_BENCH_ZK_PORT", "12281")) + 20
    parser.add_argument("--zk-port", type=int, default=zk_port, help="the port of the ZooKeeper it starts")
    parser.add_argument("--child", nargs=3, metavar=("TREE", "BACKEND", "ONCE"), help=argparse.SUPPRESS)
    return parser.parse_args()


# The child: one checkout's distlocks, one backend.


def child(tree: str, using: str, once: int, url: str, zk_port: int) -> None:
    """Run ``once`` cycles and exit (under callgrind); with ``once`` < 0, time the cycles each line of stdin asks for."""
    sys.path.insert(0, tree)
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    import django

    django.setup()
    from django.conf import settings

    import distlocks

    settings.CACHES["profile"] = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}
    settings.DISTLOCKS = {
        **settings.DISTLOCKS,
        "locmem": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"},
        "redis": {"BACKEND": "distlocks.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "profile"}},
        "zookeeper": {"BACKEND": "distlocks.backends.zookeeper.ZooKeeperBackend", "LOCATION": f"127.0.0.1:{zk_port}"},
    }
    if using in DATABASES and once < 0:  # the counted runs come after the timed one, which made the database
        from bench.db_locks import prepare

        prepare([DATABASES[using]])
    lock = distlocks.lock(f"cycle-cost-{uuid.uuid4().hex}", using=using)
    for _ in range(WARM_CYCLES):  # connections made, scripts loaded, tables warm
        lock.acquire()
        lock.release()
    if once >= 0:
        for _ in range(once):
            lock.acquire()
            lock.release()
        return
    print("ready", flush=True)
    for line in sys.stdin:
        samples = []
        for _ in range(int(line)):
            started = time.perf_counter()
            lock.acquire()
            lock.release()
            samples.append(time.perf_counter() - started)
        print(json.dumps(statistics.median(samples)), flush=True)


# The parent: both checkouts side by side.


def command(tree: Path, using: str, once: int, args: argparse.Namespace) -> list[str]:
    script = str(Path(__file__).resolve())
    return [
        sys.executable,
        script,
        "--child",
        str(tree),
        using,
        str(once),
        "--url",
        args.url,
        "--zk-port",
        str(args.zk_port),
    ]


def environment(tree: Path) -> dict[str, str]:
    # A database name per checkout (each child drops and recreates its own); hashing fixed, for callgrind's counts.
    name = f"distlocks_cycle_{'this' if tree == ROOT else 'other'}"
    return {**os.environ, "DISTLOCKS_BENCH_DATABASE": name, "PYTHONHASHSEED": "0"}


def timed(trees: list[Path], using: str, args: argparse.Namespace) -> list[list[float]]:
    """Each checkout's median cycle in each round (seconds), the checkouts taking turns."""
    children = []
    for tree in trees:
        process = subprocess.Popen(
            command(tree, using, -1, args),
            env=environment(tree),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        assert process.stdin is not None
        if process.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {using} child of {tree} did not start")
        children.append(process)
    medians: list[list[float]] = [[] for _ in trees]
    try:
        for round_ in range(args.rounds):
            order = list(range(len(trees))) if round_ % 2 == 0 else list(reversed(range(len(trees))))
            for index in order:
                stdin, stdout = children[index].stdin, children[index].stdout
                assert stdin is not None
                assert stdout is not None
                stdin.write(f"{args.cycles}\n")
                stdin.flush()
                medians[index].append(json.loads(stdout.readline()))
    finally:
        for process in children:
            assert process.stdin is not None
            process.stdin.close()
            process.wait()
    return medians


def instructions(tree: Path, using: str, args: argparse.Namespace) -> float:
    """Instructions per cycle under callgrind: ``--instructions`` cycles less none, over their number."""
    totals = []
    with tempfile.TemporaryDirectory() as directory:
        for once in (0, args.instructions):
            completed = subprocess.run(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={directory}/out"]
                + command(tree, using, once, args),
                env=environment(tree),
                capture_output=True,
                text=True,
                check=True,
            )
            found = re.search(r"Collected : (\d+)", completed.stderr)
            if found is None:
                raise SystemExit(completed.stderr[-2000:])
            totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / args.instructions


def main() -> None:
    args = arguments()
    if args.child:
        tree, using, once = args.child
        child(tree, using, int(once), args.url, args.zk_port)
        return
    with contextlib.ExitStack() as stack:
        if "zookeeper" in args.backends:
            sys.path.insert(0, str(ROOT))
            from localservers import ZooKeeperServer

            server = ZooKeeperServer(args.zk_port, stack.enter_context(tempfile.TemporaryDirectory())).start()
            stack.callback(server.stop)
        compare(args)


def compare(args: argparse.Namespace) -> None:
    """Time (and count) each backend's cycle in each checkout, and print the table."""
    trees = [ROOT] if args.against is None else [ROOT, args.against.resolve()]
    names = ["this", "other"][: len(trees)]
    rows: list[dict[str, Any]] = []
    for using in args.backends:
        medians = timed(trees, using, args)
        row: dict[str, Any] = {"backend": using}
        for name, found in zip(names, medians, strict=True):
            row[f"{name} µs"] = statistics.median(found) * 1e6
        if len(trees) == 2:
            row["this / other"] = statistics.median(a / b for a, b in zip(medians[0], medians[1], strict=True))
        if args.instructions:
            for name, tree in zip(names, trees, strict=True):
                row[f"{name} instructions"] = instructions(tree, using, args)
            if len(trees) == 2:
                row["instructions this / other"] = row["this instructions"] / row["other instructions"]
        rows.append(row)
        print(json.dumps(row, ensure_ascii=False), file=sys.stderr, flush=True)
    columns = list(rows[0])
    print(" | ".join(columns))
    print(" | ".join("---" if column == "backend" else "---:" for column in columns))
    for row in rows:
        cells = [
            row[c]
            if isinstance(row[c], str)
            else f"{row[c]:,.2f}"
            if c.endswith("other")
            else f"{row[c]:,.1f}"
            if c.endswith("µs")
            else f"{row[c]:,.0f}"
            for c in columns
        ]
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
