"""The table backend's acquires whose answer was lost, voided once the server answers again.

An ``INSERT`` of a lock (or the ``COMMIT`` of a read-write lock's side) sent
on a connection that then failed (a frozen server or proxy, a dropped
connection: ``BackendUnavailable``; or interrupted while the server did not
answer, so that its session could not be ended then) may have run, or may
still run once the server goes on, and take the lock for an owner that was
told it did not get it: the row would hold the lock, renewed by nobody, for
its ttl. So its session is ended, and waited for (nothing it was sent runs any
more), and the owner's row of that lock deleted: by a thread of this process,
again and again until the server answers, and first of all by the owner's own
next attempt at that lock, which must neither find its leftover nor have its
new row deleted by the void later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from distlocks.backends.db.connections import end_session, open_like

logger = logging.getLogger(__name__)

# A void that could not reach the server is tried again after this many seconds (besides its statements' timeouts)...
RETRY_INTERVAL = 0.5
# ... until it is this old: a server away longer than that has most likely dropped the request with its connection.
GIVE_UP = 600.0


@dataclass
class _Void:
    database: str
    key: str
    secret: str
    session: int
    began: float  # the attempt's start (monotonic)
    timeouts: tuple[float, float]  # CONNECT_TIMEOUT, TIMEOUT
    undo: Callable[[BaseDatabaseWrapper], object]  # deletes the row the attempt inserted, if it did
    since: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False

    def run(self, connection: BaseDatabaseWrapper) -> None:
        end_session(connection, self.session, self.began, self.timeouts[1])
        self.undo(connection)


_pending: dict[tuple[str, str, str], _Void] = {}
_thread: threading.Thread | None = None
_started = threading.Lock()


def void(
    database: str,
    key: str,
    secret: str,
    session: int,
    began: float,
    timeouts: tuple[float, float],
    undo: Callable[[BaseDatabaseWrapper], object],
) -> None:
    """Void, as soon as the server answers, what the ``secret`` owner's attempt at ``key`` in ``session`` took."""
    global _thread
    with _started:
        _pending[(database, key, secret)] = _Void(database, key, secret, session, began, timeouts, undo)
        if _thread is None:
            _thread = threading.Thread(target=_void_pending, name="distlocks-db-voids", daemon=True)
            _thread.start()


def settle(database: str, key: str, secret: str, run: Callable[[Callable[[BaseDatabaseWrapper], None]], None]) -> None:
    """Before the owner's next attempt at ``key``: void its lost attempt now, with ``run`` (its own ``_run``)."""
    pending = _pending.get((database, key, secret))
    if pending is None:
        return
    with pending.lock:
        if not pending.done:
            run(pending.run)
            pending.done = True
    _forget((database, key, secret), pending)


def _forget(where: tuple[str, str, str], pending: _Void) -> None:
    with _started:
        if _pending.get(where) is pending:  # not a later attempt's, lost since
            del _pending[where]


def _void_pending() -> None:
    global _thread
    while True:
        with _started:
            if not _pending:
                _thread = None
                return
        for where, pending in list(_pending.items()):
            with pending.lock:
                if not pending.done:
                    pending.done = _try(pending) or time.monotonic() - pending.since > GIVE_UP
            if pending.done:
                _forget(where, pending)
        time.sleep(RETRY_INTERVAL)


def _try(pending: _Void) -> bool:
    """Void ``pending``; True once done (or its database is no longer configured: nothing to void it on)."""
    if pending.database not in connections.settings:
        return True
    connection = None
    try:
        connection = open_like(connections[pending.database], "distlocks:void", *pending.timeouts)
        pending.run(connection)
        return True
    except Exception as exc:
        logger.debug("Could not void a lost acquire of %r yet: %s", pending.key, exc)
        return False
    finally:
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()


def _forget_after_fork() -> None:
    global _thread, _started
    _pending.clear()  # the parent's, voided by the parent's thread
    _thread, _started = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
