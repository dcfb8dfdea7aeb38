"""How SQLite's waiters are woken on one host: a release sends a datagram to the first place's socket.

SQLite has no server to wake anyone, and every process that opens the file
runs on its host: so each waiting thread binds a Unix datagram socket in
Linux's abstract namespace (nothing on disk to clean up; the kernel frees the
name when the process dies, even by SIGKILL), named after the database file,
the lock and its place in the queue. A release sends one datagram to the
first live place, as PostgreSQL's NOTIFY names it (``notify.py``). The
datagram only wakes: the waiter still takes the lock by its INSERT, and looks
at the table between wake-ups, so a lost or forged datagram costs a look,
never the lock. Elsewhere (not Linux, a name already bound) waiters poll.

Abstract names belong to a network namespace: processes in two containers
that share the database file on one host do not hear each other's releases.
A waiter that finds the lock free after a sleep no datagram ended (a release it
did not hear, unless its datagram came meanwhile) counts it; after
``UNHEARD_BEFORE_POLLING`` such sleeps in a row this process's waiters on that
file poll instead, as where there are no wake-ups, for ``POLL_FOR`` seconds,
then sleep again (a lease that ran out, a force-release, which send none,
count too: polling costs CPU, never the lock).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
import weakref

from django.db.backends.base.base import BaseDatabaseWrapper

from distlocks.backends.db.statements import sql_for

UNHEARD_BEFORE_POLLING = 3
POLL_FOR = 60.0

_bound: weakref.WeakSet[socket.socket] = weakref.WeakSet()
# Database file -> waits in a row that found the lock free with no wake-up, and since when its waiters poll.
_unheard: dict[str, int] = {}
_polling_since: dict[str, float] = {}
_sender: socket.socket | None = None


def database_id(connection: BaseDatabaseWrapper) -> str | None:
    """The SQLite file of ``connection`` as its device and inode (the same by any path), or None: no wake-ups."""
    if connection.vendor != "sqlite" or not sql_for(connection).wakes:
        return None
    try:
        stat = os.stat(connection.settings_dict["NAME"])
    except (OSError, TypeError, ValueError):  # in memory, not created yet
        return None
    return f"{stat.st_dev}:{stat.st_ino}"


def _address(database: str, key: str, place: int) -> bytes:
    digest = hashlib.blake2b(f"{database}\0{key}\0{place}".encode(), digest_size=16).hexdigest()
    return b"\0distlocks-wake-" + digest.encode()


class Alarm:
    """The socket a waiting thread sleeps on while it has place ``place`` in ``key``'s queue."""

    def __init__(self, database: str, key: str, place: int) -> None:
        self.database = database
        self.place = place
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.socket.bind(_address(database, key, place))
        except OSError:
            self.socket.close()
            raise
        _bound.add(self.socket)

    def wait(self, timeout: float) -> bool:
        """Sleep until woken (True) or for ``timeout`` seconds (False); earlier wake-ups count, and are all taken."""
        if timeout <= 0:
            return False
        self.socket.settimeout(timeout)
        try:
            self.socket.recv(16)
        except TimeoutError:
            return False
        _unheard.pop(self.database, None)
        self.socket.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # several releases named this place: one look answers them all
                self.socket.recv(16)
        return True

    def unheard(self) -> None:
        """The lock was free after a sleep that no datagram ended: count a release this process did not hear."""
        try:  # the datagram may have come after the sleep, during the look
            heard = bool(self.socket.recv(16, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:
            heard = False
        if heard:
            _unheard.pop(self.database, None)
            return
        count = _unheard[self.database] = _unheard.get(self.database, 0) + 1
        if count == UNHEARD_BEFORE_POLLING:
            _polling_since[self.database] = time.monotonic()

    def close(self) -> None:
        _bound.discard(self.socket)
        self.socket.close()


def hears(database: str) -> bool:
    """Whether this process's waiters on the ``database`` file sleep until woken (else they poll)."""
    since = _polling_since.get(database)
    if since is not None and time.monotonic() - since > POLL_FOR:  # try the wake-ups again
        del _polling_since[database]
        _unheard.pop(database, None)
    return _unheard.get(database, 0) < UNHEARD_BEFORE_POLLING


def alarm(database: str | None, key: str, place: int) -> Alarm | None:
    """An ``Alarm`` for ``place``, or None if its name cannot be bound here, or releases go unheard: then the waiter polls."""
    if database is None or not hears(database):
        return None
    try:
        return Alarm(database, key, place)
    except OSError:
        return None


def wake(database: str, key: str, place: int) -> None:
    """Send the waiter of ``place`` a wake-up, without blocking; one nobody reads (gone, full) is dropped."""
    global _sender
    with contextlib.suppress(OSError):
        if _sender is None:
            _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sender.sendto(b"w", socket.MSG_DONTWAIT, _address(database, key, place))


def wait_for(alarm: Alarm, pause: float, deadline: float | None) -> bool:
    """Sleep on ``alarm`` for ``pause`` seconds at most, not past ``deadline``: True to try at once, False to look."""
    if deadline is not None and deadline - time.monotonic() < pause:
        pause = deadline - time.monotonic()
        if pause <= 0:
            return True
    return alarm.wait(pause)


def _forget_in_child() -> None:
    """A forked child does not keep its parent's waiters' names bound (nor share its sending socket)."""
    global _sender
    for bound in list(_bound):
        bound.close()
    _bound.clear()
    _sender = None


os.register_at_fork(after_in_child=_forget_in_child)
