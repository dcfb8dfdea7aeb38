"""Benchmark the database backend against django-db-mutex and each server's own lock.

    .venv/bin/python bench/db_locks.py [--cycles 300] [--rounds 5] [--seconds 5] [--processes 4] [--databases postgresql ...]
                                       [--pin same|apart] [--uncontended-only]

Side by side in one run, on SQLite, MariaDB and PostgreSQL:
- uncontended: the latency of one acquire + release (median and p90 of every
  cycle, rounds interleaved so that noise hits every contender alike);
- contended: ``--processes`` (4) processes on one lock, timed for ``--seconds`` after a warm-up
  (see ``common.contend``), each doing a read-modify-write of a shared
  counter file inside: total cycles/s, the worst
  wait for the lock, the handoff share (how often the next holder is another
  process: 1.0 when waiters are served in turn, near 0 when one process keeps
  re-taking the lock), errors that reached the caller, and lost updates.
The floor is the server's own lock: MariaDB GET_LOCK/RELEASE_LOCK, PostgreSQL
pg_advisory_lock/pg_advisory_unlock. "native" is distlocks on that same lock
(MySQLLockBackend, AdvisoryLockBackend), reentrant, fenced and renewed. django-db-mutex does not wait: its loop
retries after 1 ms when the lock is taken.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import DatabaseError, connections  # noqa: E402

import distlocks  # noqa: E402
from bench.common import arguments, bump, contend, contender_command, gather_reports, time_cycles  # noqa: E402

DATABASES = ["default", "mariadb", "postgresql"]
IMPLS = ["floor", "django-db-mutex", "distlocks", "native"]
# The native backends' aliases (bench/settings.py), on the databases that have them.
NATIVE = {"mariadb": "mariadb_native", "postgresql": "postgresql_native"}


def cycle_of(impl: str, alias: str, name: str) -> tuple[Callable[[], bool], Callable[[], None]] | None:
    """Return (try_acquire_blocking, release) for ``impl`` on ``alias``, or None if it has none."""
    connection = connections[alias]
    if impl == "floor":
        if connection.vendor == "mysql":
            sql = ("SELECT GET_LOCK(%s, 60)", "SELECT RELEASE_LOCK(%s)")
            key: str | int = name
        elif connection.vendor == "postgresql":
            sql = ("SELECT pg_advisory_lock(%s)", "SELECT pg_advisory_unlock(%s)")
            key = zlib.crc32(name.encode())  # the same in every process
        else:
            return None
        cursor = connection.cursor()

        def floor_acquire() -> bool:
            cursor.execute(sql[0], [key])
            return True

        return floor_acquire, lambda: cursor.execute(sql[1], [key])
    if impl == "django-db-mutex":
        from db_mutex.db_mutex import db_mutex
        from db_mutex.exceptions import DBMutexError
        from db_mutex.models import DBMutex

        mutex = db_mutex(name)
        DBMutex.objects.db_manager(alias)  # noqa: B018

        def mutex_acquire() -> bool:
            try:
                with _default_db(alias):
                    mutex.start()
                return True
            except DBMutexError:
                return False

        def mutex_release() -> None:
            with _default_db(alias):
                mutex.stop()

        return mutex_acquire, mutex_release
    if impl == "native":
        if alias not in NATIVE:
            return None
        alias = NATIVE[alias]
    lock = distlocks.lock(name, using=alias, ttl=30)
    return lambda: lock.acquire(), lock.release


class _default_db:  # noqa: N801
    """Route django-db-mutex (which always uses the default database) to ``alias``."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def __enter__(self) -> None:
        if self.alias != "default":
            self.saved = connections["default"]
            connections["default"] = connections[self.alias]

    def __exit__(self, *exc: object) -> None:
        if self.alias != "default":
            connections["default"] = self.saved


def uncontended(impl: str, alias: str, cycles: int, pin: str) -> list[float]:
    pair = cycle_of(impl, alias, f"bench-{uuid.uuid4().hex}")
    if pair is None:
        return []
    time_cycles(*pair, 1)  # opens the connections it uses
    if pin != "none" and connections[alias].vendor == "postgresql":
        pin_sessions(alias, SERVER_CPU[pin])
    return time_cycles(*pair, cycles)


# Where ``--pin`` puts PostgreSQL's sessions; the benchmark itself runs on CPU 0.
SERVER_CPU = {"same": 0, "apart": 1}


def pin_sessions(alias: str, cpu: int) -> None:
    """Put every server session on ``alias``'s database on ``cpu`` (the benchmark's own: nothing else uses it).

    A round trip costs several times as much when client and server wake on
    different cores (here about 25 µs on one core, 85 µs across two), and left
    alone the scheduler decides per run: the same code then measures up to 3x
    apart from run to run, and so does its ratio to the floor.
    """
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        for (pid,) in cursor.fetchall():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(pid, {cpu})


def worker(impl: str, alias: str, name: str, seconds: float, counter: str, processes: int) -> None:
    """One of the contending processes: print cycles, worst wait, errors as JSON."""
    pair = cycle_of(impl, alias, name)
    assert pair is not None
    acquire, release = pair
    path = Path(counter)
    while not acquire():
        time.sleep(0.001)
    release()
    errors: list[str] = []

    def cycle() -> float | None:
        started = time.monotonic()
        try:
            while not acquire():
                time.sleep(0.001)
        except (DatabaseError, distlocks.BackendUnavailable) as exc:
            # Counted, not fatal: an InnoDB deadlock (1213) that django-db-mutex raises to its caller, or a server
            # error that distlocks raises as BackendUnavailable (once, MariaDB's own temporary table gone).
            errors.append(str(exc)[:80])
            return None
        waited = time.monotonic() - started
        bump(path)
        with open(f"{path}.order", "a") as order:  # who held it, in turn: for the handoff share
            order.write(f"{os.getpid()}\n")
        try:
            release()
        except (DatabaseError, distlocks.LockError) as exc:  # unavailable, or the lock lost with its session
            errors.append(str(exc)[:80])
        return waited

    waits, bumps = contend(path, processes, seconds, cycle)
    print(json.dumps({"cycles": len(waits), "worst": max(waits, default=0.0), "bumps": bumps, "errors": errors}))


def contended(impl: str, alias: str, seconds: float, processes: int, tmp: Path) -> dict[str, float] | None:
    if cycle_of(impl, alias, "probe") is None:
        return None
    counter = tmp / f"counter-{uuid.uuid4().hex}"
    counter.write_text("0")
    name = f"bench-{uuid.uuid4().hex}"
    command = contender_command(__file__, processes, [impl, alias, name, seconds, counter])
    reports = gather_reports(command, processes, seconds)
    cycles = sum(r["cycles"] for r in reports)
    turns = Path(f"{counter}.order").read_text().split()
    return {
        "handoff": sum(a != b for a, b in zip(turns, turns[1:], strict=False)) / max(1, len(turns) - 1),
        "per_second": cycles / seconds,
        "worst_ms": max(r["worst"] for r in reports) * 1000,
        "errors": sum(len(r["errors"]) for r in reports),
        "error_kinds": sorted({e for r in reports for e in r["errors"]}),
        "lost_updates": sum(r["bumps"] for r in reports) - int(counter.read_text()),
    }


def prepare(databases: list[str]) -> None:
    """Create the benchmark's databases afresh: one left by other code may hold another migration history."""
    for alias in databases:
        connection = connections[alias]
        if connection.vendor == "sqlite":
            connection.close()
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f"{connection.settings_dict['NAME']}{suffix}")
        else:
            name = connection.ops.quote_name(connection.settings_dict["NAME"])
            with connection._nodb_cursor() as cursor:
                cursor.execute(f"DROP DATABASE IF EXISTS {name}")
                cursor.execute(f"CREATE DATABASE {name}")
        call_command("migrate", database=alias, verbosity=0)


def main() -> None:
    args = arguments(__doc__, 5, databases=DATABASES, pin=True, processes=4)
    if args.worker:
        impl, alias, name, seconds, counter = args.worker
        worker(impl, alias, name, float(seconds), counter, args.processes)
        return

    from rich.console import Console
    from rich.table import Table

    databases = [alias for alias in DATABASES if alias in args.databases]
    cpus = os.sched_getaffinity(0)
    if args.pin != "none":
        os.sched_setaffinity(0, {0})
    prepare(databases)
    samples: dict[tuple[str, str], list[float]] = {(a, i): [] for a in databases for i in IMPLS}
    for _ in range(args.rounds):
        for alias in databases:
            for impl in IMPLS:
                samples[alias, impl] += uncontended(impl, alias, args.cycles, args.pin)
    tmp = args.out
    tmp.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, cpus)  # the contenders, started from here, run where the scheduler puts them
    busy = (
        {}
        if args.uncontended_only
        else {(a, i): contended(i, a, args.seconds, args.processes, tmp) for a in databases for i in IMPLS}
    )

    table = Table(
        title=f"Database locks: {args.rounds}x{args.cycles} uncontended cycles, {args.processes} processes x {args.seconds}s contended"
    )
    for column in [
        "database",
        "lock",
        "median µs",
        "p90 µs",
        "x floor",
        "x db-mutex",
        "contended/s",
        "worst wait ms",
        "handoff",
        "errors",
        "lost updates",
    ]:
        table.add_column(column, justify="left" if column in ("database", "lock") else "right")
    results = []
    for alias in databases:
        vendor = connections[alias].display_name
        floor = statistics.median(samples[alias, "floor"]) if samples[alias, "floor"] else None
        mutex = statistics.median(samples[alias, "django-db-mutex"])
        for impl in IMPLS:
            if not samples[alias, impl]:
                continue
            values = sorted(samples[alias, impl])
            median = statistics.median(values)
            p90 = values[int(len(values) * 0.9)]
            run = busy.get((alias, impl)) or {}
            row = {
                "database": vendor,
                "lock": impl,
                "median_us": median * 1e6,
                "p90_us": p90 * 1e6,
                "x_floor": median / floor if floor else None,
                "x_db_mutex": median / mutex,
                **run,
            }
            results.append(row)
            table.add_row(
                vendor,
                impl,
                f"{median * 1e6:.0f}",
                f"{p90 * 1e6:.0f}",
                f"{median / floor:.2f}" if floor else "-",
                f"{median / mutex:.2f}",
                f"{run.get('per_second', 0):.0f}",
                f"{run.get('worst_ms', 0):.1f}",
                f"{run.get('handoff', 0):.2f}",
                str(run.get("errors", "-")),
                str(run.get("lost_updates", "-")),
            )
    Console(width=160).print(table)
    (tmp / "db.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
