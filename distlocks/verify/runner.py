"""A verifier run: the tables, the worker processes, the faults injected into them, the history collected."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.conf import settings
from django.db import connections

from distlocks.exceptions import LockError
from distlocks.handler import locks
from distlocks.inspection import force_release
from distlocks.lock import DistributedLock
from distlocks.verify import tables
from distlocks.verify.history import Fault, History, Write
from distlocks.verify.processes import Pool, Worker

FAULTS = ("kill", "pause")
WORK = 0.02  # seconds between the read and the write of a section: the window a race needs


class VerifyError(Exception):
    """The run itself failed (its processes did not start): nothing was verified."""


@dataclass
class Plan:
    """What to run; see ``manage.py distlocks_verify --help``."""

    alias: str
    processes: int = 4
    seconds: float = 20.0
    ttl: float | None = None
    renew: bool = True
    faults: tuple[str, ...] = ()
    fence: bool = False  # write through distlocks.fencing
    database: str = "default"

    @property
    def lease(self) -> float:
        """How long a holder that stops answering keeps the lock: its lease, or on ZooKeeper its session."""
        backend = locks[self.alias]
        ttl = self.ttl or backend.default_ttl
        return float(getattr(backend, "session_timeout", ttl)) if backend.session_bound else ttl


@dataclass
class Outcome:
    history: History
    notes: list[str] = field(default_factory=list)  # the workers' errors, each once


Progress = Callable[[float, int, int], None]  # (seconds elapsed, sections so far, faults so far)


def run(plan: Plan, progress: Progress | None = None) -> Outcome:
    """Run ``plan``: start the workers, inject its faults until its time is up, and collect the history.

    Whatever happens (a worker that will not start, Ctrl-C), every process is
    continued and ended and the run's tables dropped before this returns or raises.
    """
    tick = progress or (lambda elapsed, cycles, faults: None)
    run_id = secrets.token_hex(4)
    name = f"distlocks-verify-{run_id}"
    config = {
        "run": run_id,
        "parent": os.getpid(),
        "name": name,
        "alias": plan.alias,
        "ttl": plan.ttl,
        "renew": plan.renew,
        "database": plan.database,
        "fence": plan.fence,
        "work": WORK,
        "settings": os.environ.get("DJANGO_SETTINGS_MODULE", ""),
        # The names in use here (a test database, say), for the workers to use too.
        "databases": {alias: os.fspath(connections[alias].settings_dict["NAME"]) for alias in settings.DATABASES},
    }
    pool: Pool | None = None
    try:
        tables.create(plan.database, run_id, fenced=plan.fence)
        pool = Pool(plan.processes, config)
        problem = pool.wait_ready(timeout=120)
        if problem:
            raise VerifyError(f"the verifier could not start its processes: {problem}")
        origin = time.monotonic()
        pool.go(origin + plan.seconds)
        faults = _inject(plan, pool, origin, tick)
        # The workers end by themselves at the deadline; a paused one first finishes its section.
        pool.stop(timeout=30)
        counter, write = tables.make_models(run_id)
        rows = write._default_manager.using(plan.database).order_by("id").values_list("id", "process", "token", "value")
        writes = [Write(*row) for row in rows]
        final = counter._default_manager.using(plan.database).values_list("value", flat=True).get(pk=1)
        sections = sorted((s for worker in pool.workers for s in worker.sections()), key=lambda s: s.start)
        history = History(sections, writes, initial=0, final=final, faults=faults, origin=origin)
        tick(plan.seconds, len(sections), len(faults))
        return Outcome(history, _notes(pool.workers))
    finally:
        if pool is not None:
            pool.stop(timeout=0)  # a no-op after a run that ended well
            pool.close()
        tables.drop(plan.database, run_id)
        with contextlib.suppress(NotImplementedError, LockError):
            force_release(plan.alias, DistributedLock(name, using=plan.alias).key)  # what a killed holder left


def _inject(plan: Plan, pool: Pool, origin: float, tick: Progress) -> list[Fault]:
    """Inject the plan's faults, one at a time in turn, into processes inside their sections, until the deadline."""
    deadline = origin + plan.seconds
    kinds = itertools.cycle(plan.faults)
    gap = min(max(plan.lease, 0.5), 5.0)  # let the lock recover between faults
    faults: list[Fault] = []
    next_at = origin + min(0.5, plan.seconds / 4)

    def wait_until(moment: float, done: Callable[[], bool] = lambda: False) -> None:
        while (now := time.monotonic()) < moment and not done():
            tick(min(now - origin, plan.seconds), pool.cycles(), len(faults))
            time.sleep(min(0.02, moment - now))

    while time.monotonic() < deadline:
        wait_until(min(next_at, deadline))
        if not plan.faults or time.monotonic() >= deadline:
            continue
        kind = next(kinds)
        if kind == "pause" and time.monotonic() + plan.lease + 1.0 > deadline:
            next_at = deadline  # too late for a pause to outlast the lease
            continue
        victim = pool.holder(within=min(1.0, max(0.0, deadline - time.monotonic())))
        fault = None
        if victim is not None and kind == "kill":
            fault = _kill(victim, pool)
        elif victim is not None:
            fault = _pause(victim, pool, plan.lease, deadline, wait_until)
        if fault is not None:
            faults.append(fault)
        next_at = time.monotonic() + (gap if fault else 0.05)
    return faults


def _kill(victim: Worker, pool: Pool) -> Fault | None:
    """SIGKILL ``victim`` inside its section, and start its replacement.

    It is stopped first and what it wrote is read, so that it cannot leave the
    section between the look and the kill. Return None (it goes on) if it had
    written already.
    """
    victim.pause()
    if not victim.in_window:
        victim.resume()
        return None
    at = victim.kill()
    pool.replace(victim)
    return Fault("kill", victim.pid, at, at)


def _pause(victim: Worker, pool: Pool, lease: float, deadline: float, wait_until: Callable[..., None]) -> Fault | None:
    """SIGSTOP ``victim`` past its lease, until another process has taken the lock and been through a section.

    Then SIGCONT it, at the run's deadline at the latest. Return None if it
    had written already when it stopped (no harm done: nothing to see).
    """
    start = time.monotonic()
    victim.pause()
    try:
        if not victim.in_window:
            return None
        wait_until(start + lease)
        wait_until(deadline, lambda: pool.taken_over(start, victim))
    finally:
        victim.resume()
    return Fault("pause", victim.pid, start, time.monotonic())


def _notes(workers: list[Worker]) -> list[str]:
    notes: dict[str, int] = {}
    for worker in workers:
        failure = worker.failure()
        errors = [section.outcome for section in worker.sections() if section.outcome.startswith("error")]
        for note in [*worker.errors(), *errors, *([failure] if failure else [])]:
            notes[note] = notes.get(note, 0) + 1
    return [note if count == 1 else f"{note} (x{count})" for note, count in notes.items()]
