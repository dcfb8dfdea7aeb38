"""Acquires whose answer was lost, voided once the server answers again: no stray hold blocks a lock for a lease.

An acquire script sent to a server that did not answer in time (frozen,
overloaded, a network that held the request) may still run once the server
goes on, after the client gave up (``BackendUnavailable``) or was interrupted:
it would take the lock for an owner that was told it did not get it, and hold
it, renewed by nobody, until its lease ran out. So every acquire carries an id
of its own, which the hash of a lock it takes (or is handed over) shows, and
an acquire whose call raised anything but the server's own error is voided
(the ``VOID`` script) by a thread of this process, one per server, again and
again until the server answers. Voiding gives back what the attempt took, if
it ran and nobody took the lock anew or re-entered it since, and makes it do
nothing if it runs later (the server remembers the id for its lease plus a
minute). It never touches a hold the owner had before, nor anyone else's. A
read-write lock's sides are voided alike (``rwscripts.RW_VOID``): the hold of
the side the attempt took, if it shows that attempt, and a writer's entry in
the queue, which would keep new readers out. A lock's last release that
raised (``release_later``) is made again alike, by the acquisition's token.

Not voided: a call the driver sent again itself (a redis-py ``Retry``) raised
nothing. Its runs answer alike (the acquire scripts know their attempt's id),
but a first run that reaches the server only after the owner's release takes
the lock again, held until its lease runs out.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from distlocks.backends.redis.scripts import registered
from distlocks.backends.redis.server import connection_errors, driver_errors

logger = logging.getLogger(__name__)

# A void that could not reach the server is tried again after this many seconds (besides the call's own timeout)...
RETRY_INTERVAL = 0.2
# ... until it is this old: a server away longer than that has most likely dropped the request with its connection.
GIVE_UP = 600.0
# The server remembers a voided attempt's id for its lease plus this (ms): the request may reach it late.
REMEMBERED_MS = 60_000
# At most this many strays wait per server (a long outage under load): past it the oldest is dropped, its lease ends it.
MAX_PENDING = 10_000
# Each acquire script's void script, and its arguments' layout: how many come before the lease (the
# attempt's id first, then what the void needs), and where the queue entry is.
VOIDS = {"acquire": ("void", 2, 4), "rw_acquire": ("rw_void", 3, 5)}


class _Ids:
    """Attempt ids unique across processes: a random prefix (new in a forked child) and a counter."""

    def __init__(self) -> None:
        self.prefix = secrets.token_hex(6)
        self.counter = itertools.count(1)


_ids = _Ids()


def attempt_id() -> str:
    """A new id for one acquire script call (``next`` on a counter is atomic: no lock)."""
    return f"{_ids.prefix}.{next(_ids.counter)}"


@dataclass(eq=False)
class Stray:
    """An acquire whose answer was lost: the client to void it on, the lock's keys and the VOID script's arguments."""

    client: Any
    keys: Sequence[str]
    args: list[Any]
    script: str = "void"
    since: float = field(default_factory=time.monotonic)

    @property
    def what(self) -> str:
        """What was lost, for the log."""
        return "a release" if self.script.endswith("force_release") else "an acquire"


class Voids:
    """One server's strays (one connection pool's), voided in order by a daemon thread that runs while any is pending.

    A server that does not answer holds up its own strays only.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: collections.deque[Stray] = collections.deque()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def add(self, stray: Stray) -> None:
        with self.lock:
            if len(self.pending) >= MAX_PENDING:
                dropped = self.pending.popleft()
                logger.warning(
                    "Too many lost acquires to void: %s keeps its stray hold until its lease ends", dropped.keys[0]
                )
            self.pending.append(stray)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="distlocks-redis-voids", daemon=True)
                self.thread.start()
        self.wake.set()

    def _loop(self) -> None:
        while True:
            try:
                self._round()
            except Exception:  # a daemon thread: log, and try again later
                logger.exception("distlocks: unexpected error while voiding lost acquires")
            with self.lock:
                if not self.pending:
                    self.thread = None
                    return
            self.wake.wait(RETRY_INTERVAL)
            self.wake.clear()

    def _round(self) -> None:
        """Void the strays in order, until the server does not answer (the rest wait for the next round)."""
        while True:
            with self.lock:
                if not self.pending:
                    return
                stray = self.pending[0]
            try:
                released = registered(stray.client)[stray.script](keys=stray.keys, args=stray.args)
            except connection_errors() as exc:
                if time.monotonic() - stray.since < GIVE_UP:
                    return
                logger.warning("Gave up undoing %s of %s whose answer was lost: %s", stray.what, stray.keys[0], exc)
            except Exception as exc:
                logger.warning("Could not undo %s of %s whose answer was lost: %s", stray.what, stray.keys[0], exc)
            else:
                if released:
                    how = "left held by" if stray.script.endswith("force_release") else "taken by"
                    logger.info("Gave back %s, %s %s whose answer was lost", stray.keys[0], how, stray.what)
            with self.lock:
                if self.pending and self.pending[0] is stray:  # else dropped meanwhile (MAX_PENDING)
                    self.pending.popleft()


# Each server's strays, by its connection pool (django-redis shares one per server among threads).
_voids: dict[Any, Voids] = {}
_voids_lock = threading.Lock()


def pending() -> list[Stray]:
    """The strays not voided yet, of every server."""
    with _voids_lock:
        servers = list(_voids.values())
    return [stray for voids in servers for stray in list(voids.pending)]


def unanswered(
    error: BaseException, script: str, keys: Sequence[str], args: list[Any], client: Callable[[], Any]
) -> TypeGuard[Exception]:
    """After a script call raised ``error``: void it if it was an acquire that the server may run still.

    Return whether ``error`` is the driver's (see ``driver_errors``: the
    caller raises BackendUnavailable). A ``ResponseError`` is the server's
    answer (the script failed there): nothing to void.
    """
    driver_error = isinstance(error, driver_errors())
    if script not in VOIDS:
        return driver_error
    from redis.exceptions import ResponseError

    if isinstance(error, ResponseError):
        return driver_error
    void, lease_at, entry_at = VOIDS[script]
    entry = args[entry_at] if len(args) > entry_at else ""
    try:
        stray = Stray(client(), keys, [*args[:lease_at], int(args[lease_at]) + REMEMBERED_MS, entry], void)
    except Exception as exc:  # no client to void it on: its lease ends it
        logger.warning("Cannot void an acquire of %s whose answer was lost: %s", keys[0], exc)
    else:
        _add(stray)
    return driver_error


def release_later(client: Callable[[], Any], keys: Sequence[str], token: int, script: str = "force_release") -> None:
    """A lock's last release raised (an interrupt, a server that did not answer): it may never have reached the
    server. Free that acquisition, by its ``token``, once the server answers, as a stray acquire is voided: a
    release that did run meanwhile (or a lock taken anew, with a larger token) leaves it nothing to do. A
    read-write lock's side is freed by ``rw_force_release``."""
    try:
        stray = Stray(client(), keys, [token], script)
    except Exception as exc:  # no client to release it on: its lease ends it
        logger.warning("Cannot release %s later: %s", keys[0], exc)
        return
    _add(stray)


def _add(stray: Stray) -> None:
    with _voids_lock:
        voids = _voids.setdefault(getattr(stray.client, "connection_pool", stray.client), Voids())
    voids.add(stray)


def _reset_after_fork() -> None:
    """A forked child voids nothing of its parent's (the parent does), and draws ids of its own."""
    global _voids, _voids_lock, _ids
    _voids, _voids_lock, _ids = {}, threading.Lock(), _Ids()


os.register_at_fork(after_in_child=_reset_after_fork)
