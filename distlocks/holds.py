"""A thread's holds on locks: what the lock and the watchdog share, in a module of its own."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from distlocks.backends.base import BaseLockBackend
from distlocks.owner import Owner

if TYPE_CHECKING:
    from distlocks.lock import DistributedLock


@dataclass(eq=False)
class Hold:
    """One thread's hold on one lock: shared by every lock object for that name."""

    lock_class: type[DistributedLock]
    backend: BaseLockBackend  # the holding thread's: it releases there
    alias: str
    name: str
    key: str
    owner: Owner
    token: int
    ttl: float
    #: When the lease ends by this process's clock, counted from before the
    #: request that took or last renewed it: past it, the hold is not proven.
    lease_ends: float
    thread: threading.Thread = field(default_factory=threading.current_thread)
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


_local = threading.local()


def holds() -> dict[tuple[str, str], Hold]:
    """Return the calling thread's holds, keyed by (alias, key)."""
    found: dict[tuple[str, str], Hold] | None = getattr(_local, "holds", None)
    if found is None:
        found = _local.holds = {}
    return found


def _forget_holds_after_fork() -> None:
    """A forked child holds nothing: the locks are its parent's."""
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_forget_holds_after_fork)
