"""What the benchmark scripts share: the command line, the timed loops, the start line, the guarded counter."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

WARM_UP = 0.5  # seconds of untimed contended cycles before the timed ones
CONTENDERS_GRACE = 120  # seconds a contended run may take beyond its timed part (start-up, the last cycles)


def arguments(
    doc: str | None,
    worker_args: int,
    cycles: int = 300,
    rounds: int = 5,
    contended_rounds: int | None = None,
    databases: Sequence[str] = (),
    pin: bool = False,
    processes: int | None = None,
    cluster: bool = False,
) -> argparse.Namespace:
    """Parse the common options; ``--worker`` (hidden) takes ``worker_args`` values.

    ``--contended-rounds`` and ``--processes`` are offered only to a script that gives them a default,
    ``--databases`` only to one that names the databases it measures on,
    ``--pin`` and ``--uncontended-only`` only to one that asks for them, as ``--cluster`` (and ``--sentinel``).
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=cycles, help="acquire+release cycles per round")
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds per contender")
    parser.add_argument("--seconds", type=float, default=5, help="length of each contended run")
    if processes is not None:
        parser.add_argument(
            "--processes", type=int, default=processes, help="processes contending for the lock in each contended run"
        )
    if contended_rounds is not None:
        parser.add_argument(
            "--contended-rounds", type=int, default=contended_rounds, help="contended runs per contender"
        )
    if databases:
        parser.add_argument(
            "--databases", nargs="+", choices=databases, default=list(databases), help="the databases to measure on"
        )
    if pin:
        parser.add_argument(
            "--pin",
            choices=["none", "same", "apart"],
            default="none",
            help="uncontended: run on CPU 0, with PostgreSQL's sessions on the same CPU or on CPU 1",
        )
        parser.add_argument("--uncontended-only", action="store_true", help="skip the contended runs")
    if cluster:
        parser.add_argument(
            "--cluster", action="store_true", help="also on a Redis Cluster the script starts (3 primaries, 3 replicas)"
        )
        parser.add_argument(
            "--sentinel",
            action="store_true",
            help="also on a Sentinel group the script starts (a master, 2 replicas, 3 sentinels)",
        )
    parser.add_argument("--url", default="redis://127.0.0.1:6379/15", help="the Redis to measure on (Redis only)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / ".bench", help="where results go (JSON)"
    )
    parser.add_argument("--worker", nargs=worker_args, help=argparse.SUPPRESS)
    return parser.parse_args()


def time_cycles(acquire: Callable[[], object], release: Callable[[], object], cycles: int) -> list[float]:
    """Return the duration of each of ``cycles`` uncontended acquire + release cycles."""
    samples = []
    for _ in range(cycles):
        started = time.perf_counter()
        acquire()
        release()
        samples.append(time.perf_counter() - started)
    return samples


def start_together(counter: Path, processes: int) -> None:
    """Wait until all ``processes`` contenders are here, so that they start their timed loops together.

    Each calls it after a warm-up cycle (connections made, scripts loaded):
    the contended runs measure contention, not interpreters starting at once.
    """
    _arrive(counter, "ready", processes, lambda: time.sleep(0.001))


def _arrive(counter: Path, where: str, processes: int, meanwhile: Callable[[], object]) -> None:
    """Say this contender is at ``where``, and run ``meanwhile`` until all ``processes`` are."""
    counter.with_name(f"{counter.name}.{where}.{os.getpid()}").touch()
    while len(list(counter.parent.glob(f"{counter.name}.{where}.*"))) < processes:
        meanwhile()


def contend(
    counter: Path, processes: int, seconds: float, cycle: Callable[[], float | None]
) -> tuple[list[float], int]:
    """Run ``cycle`` over and over as one of ``processes`` contenders; return the timed waits and all bumps.

    ``cycle`` acquires the lock, bumps ``counter`` and releases it, returning
    how long it waited for the lock (None if it failed before bumping). The
    contenders start together and cycle untimed for ``WARM_UP`` seconds (a
    process's first wait may set up what waiting needs, such as a connection),
    then ``seconds`` timed. Then each goes on cycling untimed until all are
    done, so that every timed wait is under full contention, never beside a
    contender that has stopped or is exiting.
    """
    start_together(counter, processes)
    waits: list[float] = []
    bumps = 0
    timed_from = time.monotonic() + WARM_UP
    deadline = timed_from + seconds
    while (now := time.monotonic()) < deadline:
        wait = cycle()
        if wait is not None:
            bumps += 1
            if now >= timed_from:
                waits.append(wait)

    def untimed() -> None:
        nonlocal bumps
        bumps += cycle() is not None

    _arrive(counter, "done", processes, untimed)
    return waits, bumps


def bump(counter: Path) -> None:
    """Add one to the number in ``counter`` by read-modify-write: correct only under the lock.

    Each write replaces the file whole, so overlapping holders show as lost
    updates, never as a torn number.
    """
    scratch = counter.with_name(f"{counter.name}.{os.getpid()}")
    scratch.write_text(str(int(counter.read_text()) + 1))
    os.replace(scratch, counter)


def contend_blocking(
    acquire: Callable[[], object],
    release: Callable[[], object],
    counter: Path,
    processes: int,
    seconds: float,
    note: Callable[[str], object] | None = None,
) -> tuple[list[float], int]:
    """``contend`` with a lock whose ``acquire()`` blocks until it holds: one untimed cycle first, then the timed ones.

    ``note("ask")`` and ``note("got")`` are called around each acquire, for a script that logs the order of grants.
    """
    acquire()
    release()

    def cycle() -> float:
        started = time.monotonic()
        if note:
            note("ask")
        acquire()
        if note:
            note("got")
        waited = time.monotonic() - started
        bump(counter)
        release()
        return waited

    return contend(counter, processes, seconds, cycle)


def contender_command(script: str, processes: int, worker: list[Any], options: tuple[str, ...] = ()) -> list[str]:
    """The command that runs one contender: ``script`` (a benchmark's ``__file__``) as ``--worker`` with ``worker``."""
    return [sys.executable, script, *options, "--processes", str(processes), "--worker", *map(str, worker)]


def gather_reports(command: list[str], processes: int, seconds: float) -> list[dict]:
    """Run ``processes`` copies of ``command`` and return the JSON report each prints last.

    The contenders wait for each other (``start_together``, and at the end),
    so one that fails would leave the others waiting for ever: the first to
    fail, or a run past ``seconds`` + ``CONTENDERS_GRACE``, stops them all
    with an error naming the command (its traceback is on stderr already).
    """
    with tempfile.TemporaryDirectory() as out:
        outputs = [Path(out, str(i)) for i in range(processes)]
        running: list[subprocess.Popen[bytes]] = []
        try:
            for path in outputs:
                with path.open("w") as stdout:
                    running.append(subprocess.Popen(command, stdout=stdout))
            deadline = time.monotonic() + seconds + CONTENDERS_GRACE
            while True:
                codes = [p.poll() for p in running]  # every one, each time: any() would stop at the first running
                failed = next((code for code in codes if code), None)
                if failed:
                    raise RuntimeError(f"a contender exited with {failed}: {' '.join(command)}")
                if None not in codes:
                    return [json.loads(path.read_text().splitlines()[-1]) for path in outputs]
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a contender did not finish in time: {' '.join(command)}")
                time.sleep(0.05)
        finally:
            for p in running:
                p.kill()
                p.wait()


def run_contenders(
    command: list[str], counter: Path, processes: int, seconds: float
) -> tuple[list[dict], dict[str, float]]:
    """Start ``processes`` copies of ``command`` (each prints a JSON report with its ``waits`` and ``bumps``).

    Return their reports and the figures of the run: grants per second, the
    median, 99th percentile and worst wait, and the updates lost on ``counter``.
    """
    reports = gather_reports(command, processes, seconds)
    waits = sorted(w for r in reports for w in r["waits"])
    return reports, {
        "per_second": len(waits) / seconds,
        "median_wait_ms": statistics.median(waits) * 1000,
        "p99_wait_ms": waits[int(len(waits) * 0.99)] * 1000,
        "worst_wait_ms": waits[-1] * 1000,
        "lost_updates": sum(r["bumps"] for r in reports) - int(counter.read_text()),
    }
