"""Acquires whose answer was lost, voided once the server answers again: no stray hold blocks a lock for a lease.

An acquire script sent to a server that did not answer in time (frozen,
overloaded, a network that held the request) may still run once the server
goes on, after the client gave up (``BackendUnavailable``) or was interrupted:
it would take the lock for an owner that was told it did not get it, and hold
it, renewed by nobody, until its lease ran out. So every acquire carries an id
of its own, which the hash of a lock it takes (or is handed over) shows, and
an acquire whose call raised anything but the server's own error is voided
(the ``VOID`` script) by a thread of this process, again and again until the
server answers. Voiding gives back what the attempt took, if it ran and nobody
took the lock anew or re-entered it since, and makes it do nothing if it runs
later (the server remembers the id for its lease plus a minute). It never
touches a hold the owner had before, nor anyone else's.
"""

from __future__ import annotations

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
from distlocks.backends.redis.server import connection_errors

logger = logging.getLogger(__name__)

# A void that could not reach the server is tried again after this many seconds (besides the call's own timeout)...
RETRY_INTERVAL = 0.2
# ... until it is this old: a server away longer than that has most likely dropped the request with its connection.
GIVE_UP = 600.0
# The server remembers a voided attempt's id for its lease plus this (ms): the request may reach it late.
REMEMBERED_MS = 60_000


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
    since: float = field(default_factory=time.monotonic)


class Voids:
    """This process's strays, voided in order by one daemon thread started on demand."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[Stray] = []
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.voided = 0  # how many were voided (the server answered), for tests and logs

    def add(self, stray: Stray) -> None:
        with self.lock:
            self.pending.append(stray)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="distlocks-redis-voids", daemon=True)
                self.thread.start()
        self.wake.set()

    def _loop(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            try:
                while self._round():
                    self.wake.wait(RETRY_INTERVAL)
                    self.wake.clear()
            except Exception:  # a daemon thread: log, and carry on at the next wake-up
                logger.exception("distlocks: unexpected error while voiding lost acquires")
                self.wake.set()
                time.sleep(RETRY_INTERVAL)

    def _round(self) -> bool:
        """Void what can be voided now; return whether any is left for later.

        A server that does not answer holds up its own strays only, and is
        asked once per round: the others behind the first wait for the next.
        """
        with self.lock:
            strays = list(self.pending)
        unreachable: set[int] = set()
        done = []
        for stray in strays:
            if id(stray.client) in unreachable:
                continue
            try:
                released = registered(stray.client)["void"](keys=stray.keys, args=stray.args)
            except connection_errors() as exc:
                if time.monotonic() - stray.since < GIVE_UP:
                    unreachable.add(id(stray.client))
                    continue
                logger.warning("Gave up voiding an acquire of %s whose answer was lost: %s", stray.keys[0], exc)
            except Exception as exc:
                logger.warning("Could not void an acquire of %s whose answer was lost: %s", stray.keys[0], exc)
            else:
                self.voided += 1
                if released:
                    logger.info("Gave back %s, taken by an acquire whose answer was lost", stray.keys[0])
            done.append(stray)
        with self.lock:
            self.pending = [stray for stray in self.pending if stray not in done]
            return bool(self.pending)


_voids = Voids()


def voids() -> Voids:
    return _voids


def unanswered(
    error: BaseException, script: str, keys: Sequence[str], args: list[Any], client: Callable[[], Any]
) -> TypeGuard[Exception]:
    """After a script call raised ``error``: void it if it was an acquire that the server may run still.

    Return whether ``error`` is the driver's for a server it could not reach
    (the caller raises BackendUnavailable). A ``ResponseError`` is the server's
    answer (the script failed there): nothing to void.
    """
    unreachable = isinstance(error, connection_errors())
    if script != "acquire":
        return unreachable
    from redis.exceptions import ResponseError

    if isinstance(error, ResponseError):
        return unreachable
    attempt, secret, lease = args[0], args[1], args[2]
    entry = args[4] if len(args) > 4 else ""
    try:
        stray = Stray(client(), keys, [attempt, secret, int(lease) + REMEMBERED_MS, entry])
    except Exception as exc:  # no client to void it on: its lease ends it
        logger.warning("Cannot void an acquire of %s whose answer was lost: %s", keys[0], exc)
    else:
        _voids.add(stray)
    return unreachable


def _reset_after_fork() -> None:
    """A forked child voids nothing of its parent's (the parent does), and draws ids of its own."""
    global _voids, _ids
    _voids = Voids()
    _ids = _Ids()


os.register_at_fork(after_in_child=_reset_after_fork)
