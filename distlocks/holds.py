"""A thread's (or an asyncio task's) holds on locks: what the lock and the watchdog share, in a module of its own."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from distlocks.backends.base import BaseLockBackend
from distlocks.owner import Owner


class LockKind(Protocol):
    """A kind of lock (``DistributedLock`` or a subclass): the sender of its signals, and what it calls on a backend."""

    @classmethod
    def primitives(cls, backend: BaseLockBackend) -> BaseLockBackend: ...


class Holder(Protocol):
    """What holds a lock and whose end the watchdog notices: a thread, or an asyncio task (``distlocks.aio``)."""

    @property
    def name(self) -> str: ...

    def is_alive(self) -> bool: ...


def current_holder() -> Holder:
    """The holder the calling thread acts for: the task it runs a step of (``acting_for``), or itself."""
    return _local.holder


@dataclass(eq=False)
class Hold:
    """One thread's hold on one lock: shared by every lock object for that name."""

    lock_class: type[LockKind]
    backend: BaseLockBackend  # the instance it was taken with (see backend_here)
    alias: str
    name: str
    key: str
    owner: Owner
    token: int
    ttl: float
    #: When the lease ends by this process's clock, counted from before the
    #: request that took or last renewed it: past it, the hold is not proven.
    lease_ends: float
    thread: Holder = field(default_factory=current_holder)
    count: int = 1
    lost: bool = False
    lost_told: bool = False  # lock_lost was sent for it
    #: Inner acquires and releases whose request failed: the server may count
    #: up to this many holds more than ``count``, so the last release makes sure.
    uncounted: int = 0
    #: When the lock was taken (monotonic), for the ``held`` of ``lock_released``.
    acquired: float = field(default_factory=time.monotonic)

    def renewed(self, started: float, ttl: float | None = None) -> None:
        """Note a renewal for ``ttl`` (default: the hold's) whose request left at ``started`` (monotonic).

        A lease only ever grows here: a slower renewal answered after a later
        one must not shorten it.
        """
        self.lease_ends = max(self.lease_ends, started + (self.ttl if ttl is None else ttl))

    def backend_here(self) -> BaseLockBackend:
        """The backend instance to call about this hold from the calling thread.

        A thread's hold is called on the instance it was taken with. A task's
        hold moves between pool threads, and a database connection must stay in
        the thread that opened it: the calling thread's instance of the alias
        (every backend finds a hold by its owner, not by the instance).
        """
        if isinstance(self.thread, threading.Thread):
            return self.backend
        from distlocks.handler import locks

        return self.lock_class.primitives(locks[self.alias])


class _Local(threading.local):
    """Who the calling thread acts for (itself, or a task: ``acting_for``) and that holder's holds.

    Set up at the thread's first use and read as attributes, one read each:
    every acquire and release reads them (``getattr`` with a default raised and
    swallowed an AttributeError whenever the attribute was missing).
    """

    def __init__(self) -> None:
        self.holder: Holder = threading.current_thread()
        self.holds: dict[tuple[str, str], Hold] = {}


_local = _Local()


def holds() -> dict[tuple[str, str], Hold]:
    """Return the calling thread's holds (those of the task it acts for), keyed by (alias, key)."""
    return _local.holds


@contextlib.contextmanager
def acting_for(holder: Holder, table: dict[tuple[str, str], Hold]) -> Iterator[None]:
    """Make ``holder`` (a task) and its ``table`` of holds the calling thread's while the block runs."""
    local = _local
    previous = local.holder, local.holds
    local.holder, local.holds = holder, table
    try:
        yield
    finally:
        local.holder, local.holds = previous


def _forget_holds_after_fork() -> None:
    """A forked child holds nothing: the locks are its parent's."""
    global _local
    _local = _Local()


os.register_at_fork(after_in_child=_forget_holds_after_fork)
