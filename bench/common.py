"""What the benchmark scripts share: the command line, the timed loop, the start line, the guarded counter."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path


def arguments(
    doc: str | None, worker_args: int, cycles: int = 300, contended_rounds: int | None = None
) -> argparse.Namespace:
    """Parse the common options; ``--worker`` (hidden) takes ``worker_args`` values.

    ``--contended-rounds`` is offered only to a script that gives it a default.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=cycles, help="acquire+release cycles per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per contender")
    parser.add_argument("--seconds", type=float, default=5, help="length of each contended run")
    if contended_rounds is not None:
        parser.add_argument(
            "--contended-rounds", type=int, default=contended_rounds, help="contended runs per contender"
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
    counter.with_name(f"{counter.name}.ready.{os.getpid()}").touch()
    while len(list(counter.parent.glob(f"{counter.name}.ready.*"))) < processes:
        time.sleep(0.001)


def bump(counter: Path) -> None:
    """Add one to the number in ``counter`` by read-modify-write: correct only under the lock.

    Each write replaces the file whole, so overlapping holders show as lost
    updates, never as a torn number.
    """
    scratch = counter.with_name(f"{counter.name}.{os.getpid()}")
    scratch.write_text(str(int(counter.read_text()) + 1))
    os.replace(scratch, counter)
